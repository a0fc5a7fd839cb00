//! What this peer's DHT store keeps for others (Kademlia runs with `StoreInserts::FilterBoth`, so every inbound
//! put lands here first): only server records signed by the peer they belong to, and provider records for Petal's
//! own keys, at most [`MAX_PROVIDED_KEYS_PER_PEER`] per provider. Anything else is dropped, so no peer can write
//! in another's name or fill the store.
use std::collections::HashMap;
use std::time::Instant;

use libp2p::{
    kad::{self, store::RecordStore, ProviderRecord, Record},
    PeerId,
};

use super::Actor;
use crate::records::{now_unix_ms, verify_record, SERVERS_KEY};

/// Keys one peer may provide through this store: the all-servers key and a few models (a node serves one).
pub const MAX_PROVIDED_KEYS_PER_PEER: usize = 8;
/// Longest provider key accepted (`/petal/model/` and a model id).
const MAX_PROVIDER_KEY_BYTES: usize = 256;

/// Provider keys accepted per provider, with when each runs out; bounds every provider's share of the store.
#[derive(Default)]
pub(super) struct ProviderQuotas {
    keys: HashMap<PeerId, HashMap<kad::RecordKey, Option<Instant>>>,
}

impl ProviderQuotas {
    /// Whether `record` fits its provider's quota (and counts it if so).
    fn admit(&mut self, record: &ProviderRecord, now: Instant) -> bool {
        let keys = self.keys.entry(record.provider).or_default();
        drop_expired(keys, now);
        if keys.len() >= MAX_PROVIDED_KEYS_PER_PEER && !keys.contains_key(&record.key) {
            return false;
        }
        keys.insert(record.key.clone(), record.expires);
        true
    }

    /// Forgets providers whose keys have all run out.
    pub(super) fn prune(&mut self, now: Instant) {
        self.keys.retain(|_, keys| {
            drop_expired(keys, now);
            !keys.is_empty()
        });
    }
}

fn drop_expired(keys: &mut HashMap<kad::RecordKey, Option<Instant>>, now: Instant) {
    keys.retain(|_, expires| expires.is_none_or(|t| t > now));
}

fn is_petal_provider_key(key: &[u8]) -> bool {
    key == SERVERS_KEY || (key.starts_with(b"/petal/model/") && key.len() <= MAX_PROVIDER_KEY_BYTES)
}

impl Actor {
    pub(super) fn on_inbound_put(&mut self, source: PeerId, record: Record) {
        match verify_record(record.key.as_ref(), &record.value, now_unix_ms()) {
            Ok(_) => {
                if let Err(e) = self.swarm.behaviour_mut().kad.store_mut().put(record) {
                    tracing::debug!(%source, error = ?e, "server record not stored");
                }
            }
            Err(e) => tracing::debug!(%source, error = %e, "refusing to store a DHT record"),
        }
    }

    pub(super) fn on_inbound_provider(&mut self, record: ProviderRecord) {
        let provider = record.provider;
        if !is_petal_provider_key(record.key.as_ref()) {
            tracing::debug!(%provider, "refusing a provider record for a foreign key");
            return;
        }
        if !self.provider_quotas.admit(&record, Instant::now()) {
            tracing::debug!(%provider, quota = MAX_PROVIDED_KEYS_PER_PEER, "refusing a provider record over quota");
            return;
        }
        if let Err(e) = self
            .swarm
            .behaviour_mut()
            .kad
            .store_mut()
            .add_provider(record)
        {
            tracing::debug!(%provider, error = ?e, "provider record not stored");
        }
    }
}

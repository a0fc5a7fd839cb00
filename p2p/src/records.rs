//! How servers are announced in the DHT and found again.
//!
//! Layout: each server stores its prost-encoded [`ServerRecord`] under [`server_key`]`(its peer id)` and is a
//! Kademlia *provider* of [`model_key`]`(model id)` and of [`SERVERS_KEY`]. Providers make "who serves model X"
//! a single lookup without a shared mutable value (a DHT key holds one value per store, so a list of servers
//! under one key would be a last-writer-wins race); the per-server record then carries the details.
//!
//! Liveness is decided by the record itself ([`is_live`]), not by the DHT: stores may still hold a stale copy,
//! and provider records outlive a withdrawal, but a withdrawn or expired record is never reported.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use futures::{stream::FuturesUnordered, StreamExt};
use libp2p::{Multiaddr, PeerId};
use petal_proto::pb::ServerRecord;
use prost::Message;

use crate::{NetError, Network};

/// Providers of this key serve the model `model_id` (a weights fingerprint, see petal-model's `ModelId`).
pub fn model_key(model_id: &str) -> Vec<u8> {
    format!("/petal/model/{model_id}").into_bytes()
}

/// Every server provides this key, whatever its model, so `petal list`-style tools can see the whole swarm.
pub const SERVERS_KEY: &[u8] = b"/petal/servers";

/// Key of the DHT record holding `peer`'s [`ServerRecord`].
pub fn server_key(peer: &PeerId) -> Vec<u8> {
    format!("/petal/server/{peer}").into_bytes()
}

/// Wall-clock time in Unix milliseconds, as stamped in `ServerRecord.updated_unix_ms`.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A record is live if not withdrawn and refreshed within its own TTL. Compares wall clocks of two machines,
/// so clocks skewed by more than the TTL hide (or keep) a server; NTP keeps real skew far below the 60 s default.
pub fn is_live(record: &ServerRecord, now_ms: u64) -> bool {
    !record.withdrawn && record.updated_unix_ms.saturating_add(record.ttl_ms) >= now_ms
}

/// Decodes every value found under `peer`'s server key and keeps the newest one that really is `peer`'s.
/// Several versions can coexist in the DHT (stores that missed the latest put); undecodable values, and values
/// naming another peer (anyone can write any key), are skipped.
fn newest_record(peer: &PeerId, values: Vec<Vec<u8>>) -> Option<ServerRecord> {
    let peer_str = peer.to_string();
    values
        .into_iter()
        .filter_map(|bytes| match ServerRecord::decode(bytes.as_slice()) {
            Ok(record) => Some(record),
            Err(e) => {
                tracing::debug!(%peer, error = %e, "skipping undecodable server record");
                None
            }
        })
        .filter(|record| {
            let ours = record.peer_id == peer_str;
            if !ours {
                tracing::debug!(%peer, claimed = %record.peer_id, "skipping record stored under another peer's key");
            }
            ours
        })
        .max_by_key(|record| record.updated_unix_ms)
}

/// Looks up one server's record, bounded by `deadline`.
async fn lookup_record(
    net: &Network,
    peer: PeerId,
    deadline: tokio::time::Instant,
) -> (PeerId, Result<Option<ServerRecord>, NetError>) {
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    let result = net
        .get_records(server_key(&peer), remaining)
        .await
        .map(|values| newest_record(&peer, values));
    (peer, result)
}

/// Finds the live servers of `model_id` (or of any model, with `None`).
///
/// Streams the providers of [`model_key`] (or [`SERVERS_KEY`]) and looks up each one's [`server_key`] record as
/// soon as it is found, concurrently; everything is bounded by `timeout` overall, and what was found by then is
/// returned. Each live record's addresses go into the network's address book, so
/// [`Network::open_stream`] can dial the server. Sorted by (start_block, peer_id).
pub async fn find_servers(
    net: &Network,
    model_id: Option<&str>,
    timeout: Duration,
) -> Result<Vec<ServerRecord>, NetError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let key = model_id.map_or_else(|| SERVERS_KEY.to_vec(), model_key);
    let (query, mut providers) = net.providers_stream(key).await?;

    let mut asked = HashSet::new();
    let mut lookups = FuturesUnordered::new();
    let mut records: HashMap<PeerId, ServerRecord> = HashMap::new();
    let mut providers_open = true;
    let sleep = tokio::time::sleep_until(deadline);
    tokio::pin!(sleep);
    while providers_open || !lookups.is_empty() {
        tokio::select! {
            batch = providers.recv(), if providers_open => match batch {
                Some(batch) => {
                    for peer in batch {
                        if asked.insert(peer) {
                            lookups.push(lookup_record(net, peer, deadline));
                        }
                    }
                }
                None => providers_open = false,
            },
            Some((peer, result)) = lookups.next(), if !lookups.is_empty() => {
                match result {
                    Ok(Some(record)) => {
                        records.insert(peer, record);
                    }
                    Ok(None) => tracing::debug!(%peer, "provider has no server record"),
                    Err(NetError::Closed) => return Err(NetError::Closed),
                    Err(e) => tracing::debug!(%peer, error = %e, "server record lookup failed"),
                }
            }
            () = &mut sleep => {
                tracing::debug!(found = records.len(), pending = lookups.len(), "find_servers timed out; returning what was found");
                break;
            }
        }
    }
    if providers_open {
        net.cancel_query(query).await;
    }

    let now = now_unix_ms();
    let mut live: Vec<ServerRecord> = records
        .into_values()
        .filter(|r| is_live(r, now))
        .filter(|r| model_id.is_none_or(|id| r.model_id == id))
        .collect();
    for record in &live {
        let Ok(peer) = record.peer_id.parse::<PeerId>() else {
            continue;
        };
        let addrs: Vec<Multiaddr> = record.addrs.iter().filter_map(|a| a.parse().ok()).collect();
        if !addrs.is_empty() {
            net.add_addresses(peer, addrs).await;
        }
    }
    live.sort_by(|a, b| (a.start_block, &a.peer_id).cmp(&(b.start_block, &b.peer_id)));
    Ok(live)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(peer: &PeerId, updated: u64) -> ServerRecord {
        ServerRecord {
            peer_id: peer.to_string(),
            updated_unix_ms: updated,
            ttl_ms: 1000,
            ..Default::default()
        }
    }

    #[test]
    fn keys_are_distinct_and_readable() {
        let peer = PeerId::random();
        assert_eq!(model_key("abc"), b"/petal/model/abc".to_vec());
        assert_eq!(
            server_key(&peer),
            format!("/petal/server/{peer}").into_bytes()
        );
        assert_ne!(model_key("x"), SERVERS_KEY.to_vec());
    }

    #[test]
    fn liveness() {
        let peer = PeerId::random();
        let r = record(&peer, 10_000);
        assert!(is_live(&r, 10_500));
        assert!(is_live(&r, 11_000));
        assert!(!is_live(&r, 11_001));
        let withdrawn = ServerRecord {
            withdrawn: true,
            ..r.clone()
        };
        assert!(!is_live(&withdrawn, 10_000));
        let forever = ServerRecord {
            ttl_ms: u64::MAX,
            ..r
        };
        assert!(is_live(&forever, u64::MAX));
    }

    #[test]
    fn newest_wins_and_garbage_is_skipped() {
        let peer = PeerId::random();
        let other = PeerId::random();
        let values = vec![
            record(&peer, 5).encode_to_vec(),
            b"\xff\xff not a record".to_vec(),
            record(&peer, 9).encode_to_vec(),
            record(&other, 99).encode_to_vec(),
        ];
        let newest = newest_record(&peer, values).map(|r| r.updated_unix_ms);
        assert_eq!(newest, Some(9));
        assert!(newest_record(&peer, vec![]).is_none());
    }
}

//! How servers are announced in the DHT and found again.
//!
//! Layout: each server stores its prost-encoded [`ServerRecord`] under [`server_key`]`(its peer id)` and is a
//! Kademlia *provider* of [`model_key`]`(model id)` and of [`SERVERS_KEY`]. Providers make "who serves model X"
//! a single lookup without a shared mutable value (a DHT key holds one value per store, so a list of servers
//! under one key would be a last-writer-wins race); the per-server record then carries the details.
//!
//! Liveness is decided by the record itself ([`is_live`]), not by the DHT: stores may still hold a stale copy,
//! and provider records outlive a withdrawal, but a withdrawn or expired record is never reported.
//!
//! Records are signed ([`sign_record`]): the value under `server_key(P)` counts only if P's own key signed it and
//! its clock is not ahead of ours by more than [`MAX_CLOCK_SKEW`] ([`verify_record`]). Stores check that before
//! keeping a value (see the actor's inbound-request filter) and readers check it again, since a hostile store can
//! answer anything.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use futures::{stream::FuturesUnordered, StreamExt};
use libp2p::{
    identity::{Keypair, PublicKey},
    Multiaddr, PeerId,
};
use petal_proto::pb::{ServerRecord, SignedServerRecord};
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

/// Prefix of the signed bytes, so a record signature can never pass for a signature over anything else.
const SIGNING_DOMAIN: &[u8] = b"petal-server-record:";
/// How far ahead of our clock a record's `updated_unix_ms` may be (honest machines run NTP). A record further
/// ahead would outlive every later one of the same server, since the newest wins.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(30);
/// Largest signed record a store keeps or a reader accepts.
pub const MAX_RECORD_BYTES: usize = 16 * 1024;

/// Why a DHT value is not a valid server record.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("value of {0} bytes is larger than {MAX_RECORD_BYTES}")]
    TooLarge(usize),
    #[error("not a signed server record: {0}")]
    Undecodable(String),
    #[error("invalid public key: {0}")]
    BadKey(String),
    #[error("the key {key:?} is not the signer's ({signer}) server key")]
    WrongKey { key: String, signer: PeerId },
    #[error("the record names peer {claimed} but {signer} signed it")]
    WrongPeer { claimed: String, signer: PeerId },
    #[error("bad signature")]
    BadSignature,
    #[error("stamped {ahead_ms} ms in the future")]
    FromTheFuture { ahead_ms: u64 },
}

/// Signs `record` with `keypair` (whose peer id the record must name) into the value stored under its server
/// key.
pub fn sign_record(keypair: &Keypair, record: &ServerRecord) -> Result<Vec<u8>, NetError> {
    let bytes = record.encode_to_vec();
    let signature = keypair
        .sign(&[SIGNING_DOMAIN, &bytes].concat())
        .map_err(|e| NetError::Dht(format!("cannot sign the server record: {e}")))?;
    Ok(SignedServerRecord {
        record: bytes,
        public_key: keypair.public().encode_protobuf(),
        signature,
    }
    .encode_to_vec())
}

/// The record in `value` stored under `key`, if it is a server record signed by the peer that `key` belongs to,
/// names that peer, and is not stamped more than [`MAX_CLOCK_SKEW`] after `now_ms`.
pub fn verify_record(key: &[u8], value: &[u8], now_ms: u64) -> Result<ServerRecord, RecordError> {
    if value.len() > MAX_RECORD_BYTES {
        return Err(RecordError::TooLarge(value.len()));
    }
    let signed =
        SignedServerRecord::decode(value).map_err(|e| RecordError::Undecodable(e.to_string()))?;
    let public_key = PublicKey::try_decode_protobuf(&signed.public_key)
        .map_err(|e| RecordError::BadKey(e.to_string()))?;
    let signer = public_key.to_peer_id();
    if key != server_key(&signer).as_slice() {
        return Err(RecordError::WrongKey {
            key: String::from_utf8_lossy(key).into_owned(),
            signer,
        });
    }
    if !public_key.verify(
        &[SIGNING_DOMAIN, &signed.record].concat(),
        &signed.signature,
    ) {
        return Err(RecordError::BadSignature);
    }
    let record = ServerRecord::decode(signed.record.as_slice())
        .map_err(|e| RecordError::Undecodable(e.to_string()))?;
    if record.peer_id != signer.to_string() {
        return Err(RecordError::WrongPeer {
            claimed: record.peer_id,
            signer,
        });
    }
    let skew = u64::try_from(MAX_CLOCK_SKEW.as_millis()).unwrap_or(u64::MAX);
    if record.updated_unix_ms > now_ms.saturating_add(skew) {
        return Err(RecordError::FromTheFuture {
            ahead_ms: record.updated_unix_ms - now_ms,
        });
    }
    Ok(record)
}

/// Verifies every value found under `peer`'s server key and keeps the newest valid one. Several versions can
/// coexist in the DHT (stores that missed the latest put); forged, unsigned and undecodable values are skipped.
fn newest_record(peer: &PeerId, values: Vec<Vec<u8>>) -> Option<ServerRecord> {
    let key = server_key(peer);
    let now = now_unix_ms();
    values
        .into_iter()
        .filter_map(|bytes| match verify_record(&key, &bytes, now) {
            Ok(record) => Some(record),
            Err(e) => {
                tracing::debug!(%peer, error = %e, "skipping invalid server record");
                None
            }
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
    fn newest_valid_record_wins_and_forgeries_are_skipped() {
        let key = Keypair::generate_ed25519();
        let peer = key.public().to_peer_id();
        let mallory = Keypair::generate_ed25519();
        let now = now_unix_ms();
        let signed = |k: &Keypair, r: &ServerRecord| sign_record(k, r).expect("sign");
        let values = vec![
            signed(&key, &record(&peer, now - 5)),
            b"\xff\xff not a record".to_vec(),
            signed(&key, &record(&peer, now - 1)),
            // Unsigned, newer, withdrawn: the old layout anyone could write.
            ServerRecord {
                withdrawn: true,
                ..record(&peer, now)
            }
            .encode_to_vec(),
            // Signed by another peer in `peer`'s name.
            signed(&mallory, &record(&peer, now)),
        ];
        let newest = newest_record(&peer, values).map(|r| r.updated_unix_ms);
        assert_eq!(newest, Some(now - 1));
        assert!(newest_record(&peer, vec![]).is_none());
    }

    #[test]
    fn verification_names_what_is_wrong() {
        let key = Keypair::generate_ed25519();
        let peer = key.public().to_peer_id();
        let mallory = Keypair::generate_ed25519();
        let now = 1_000_000_000;
        let ok = sign_record(&key, &record(&peer, now)).expect("sign");
        assert_eq!(
            verify_record(&server_key(&peer), &ok, now).map(|r| r.updated_unix_ms),
            Ok(now)
        );
        // Stored under someone else's key.
        let other = PeerId::random();
        assert!(matches!(
            verify_record(&server_key(&other), &ok, now),
            Err(RecordError::WrongKey { .. })
        ));
        // Mallory signs a record naming `peer`, under Mallory's own key.
        let forged = sign_record(&mallory, &record(&peer, now)).expect("sign");
        let mallory_key = server_key(&mallory.public().to_peer_id());
        assert!(matches!(
            verify_record(&mallory_key, &forged, now),
            Err(RecordError::WrongPeer { .. })
        ));
        // A flipped byte in the record breaks the signature.
        let mut tampered = SignedServerRecord::decode(ok.as_slice()).expect("decode");
        let last = tampered.record.len() - 1;
        tampered.record[last] ^= 1;
        assert_eq!(
            verify_record(&server_key(&peer), &tampered.encode_to_vec(), now),
            Err(RecordError::BadSignature)
        );
        // Far-future timestamps would win `newest` forever.
        let future = sign_record(&key, &record(&peer, u64::MAX / 2)).expect("sign");
        assert!(matches!(
            verify_record(&server_key(&peer), &future, now),
            Err(RecordError::FromTheFuture { .. })
        ));
        let skewed = now + MAX_CLOCK_SKEW.as_millis() as u64;
        let within = sign_record(&key, &record(&peer, skewed)).expect("sign");
        assert!(verify_record(&server_key(&peer), &within, now).is_ok());
        assert!(matches!(
            verify_record(&server_key(&peer), &vec![0u8; MAX_RECORD_BYTES + 1], now),
            Err(RecordError::TooLarge(_))
        ));
    }
}

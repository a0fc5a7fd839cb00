//! What one peer may make the node spend beyond its sessions: bytes of frames not yet handled, time to deliver a
//! frame, memory of one step, and cheap requests (Info, undecodable frames) per second.
//!
//! Sessions and cache are admission's ([`crate::admission`]); connections are the network's (libp2p connection
//! limits). Everything here is keyed by peer, so one peer's abuse costs others nothing beyond the node-wide pools.
use petal_p2p::PeerId;
use petal_proto::{RecvBudget, RecvLimits};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// The limits a node serves under (flags of `petal-node serve`; defaults in [`ServeLimits::default`]).
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// A stream with no request for this long is closed, its sessions with it.
    pub session_timeout: Duration,
    pub max_frame_bytes: usize,
    /// A frame must arrive whole this long after its first byte.
    pub frame_timeout: Duration,
    /// Bytes of received, unhandled frames one peer may hold across its streams (at least `max_frame_bytes`).
    pub peer_buffer_bytes: usize,
    /// The same across all peers.
    pub buffer_bytes: usize,
    /// Working memory one step may need ([`petal_model::compute::block::step_working_bytes`]); 0: no limit.
    pub max_step_bytes: u64,
    /// Cheap requests (Info, undecodable frames) a peer may send per second, on average.
    pub cheap_per_sec: f64,
    /// And in a burst.
    pub cheap_burst: f64,
}

impl Default for ServeLimits {
    fn default() -> Self {
        let max_frame_bytes = petal_proto::DEFAULT_MAX_FRAME_BYTES;
        Self {
            session_timeout: Duration::from_secs(300),
            max_frame_bytes,
            frame_timeout: Duration::from_secs(60),
            peer_buffer_bytes: 2 * max_frame_bytes,
            buffer_bytes: 8 * max_frame_bytes,
            max_step_bytes: 4 << 30,
            cheap_per_sec: 20.0,
            cheap_burst: 100.0,
        }
    }
}

impl ServeLimits {
    /// A frame of the largest size must always fit in a peer's pool and the node's, or it would wait forever.
    pub fn validate(&self) -> Result<(), String> {
        if self.peer_buffer_bytes < self.max_frame_bytes {
            return Err(format!(
                "--peer-buffer ({} MiB) must hold one frame of the largest size ({} MiB)",
                self.peer_buffer_bytes >> 20,
                self.max_frame_bytes.div_ceil(1 << 20)
            ));
        }
        if self.buffer_bytes < self.peer_buffer_bytes {
            return Err(format!(
                "--recv-buffer ({} MiB) must be at least --peer-buffer ({} MiB)",
                self.buffer_bytes >> 20,
                self.peer_buffer_bytes >> 20
            ));
        }
        if !(self.cheap_per_sec > 0.0 && self.cheap_burst >= 1.0) {
            return Err("--cheap-rate must be positive (and its burst at least 1)".into());
        }
        Ok(())
    }
}

/// Per-peer receive pools and request buckets.
#[derive(Debug)]
pub struct PeerLimits {
    limits: ServeLimits,
    node_pool: Arc<Semaphore>,
    /// A peer's pool lives while one of its streams holds it.
    pools: Mutex<HashMap<PeerId, Weak<Semaphore>>>,
    buckets: Mutex<HashMap<PeerId, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Peers remembered for rate limiting before those idle longest are forgotten (a bucket refilled to its burst is
/// the same as none).
const MAX_BUCKETS: usize = 4096;

impl PeerLimits {
    pub fn new(limits: ServeLimits) -> Self {
        Self {
            node_pool: RecvBudget::pool(limits.buffer_bytes),
            limits,
            pools: Mutex::new(HashMap::new()),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    pub fn limits(&self) -> &ServeLimits {
        &self.limits
    }

    /// What a stream of `peer` may receive: its frame deadline, its peer's pool and the node's.
    pub fn recv_limits(&self, peer: PeerId) -> RecvLimits {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let pool = match pools.get(&peer).and_then(Weak::upgrade) {
            Some(pool) => pool,
            None => {
                pools.retain(|_, w| w.strong_count() > 0);
                let pool = RecvBudget::pool(self.limits.peer_buffer_bytes);
                pools.insert(peer, Arc::downgrade(&pool));
                pool
            }
        };
        RecvLimits {
            frame_timeout: Some(self.limits.frame_timeout),
            budget: RecvBudget::new(vec![pool, self.node_pool.clone()]),
        }
    }

    /// Takes one cheap request from `peer`'s bucket; `false` when it is empty.
    pub fn allow_cheap(&self, peer: PeerId) -> bool {
        let (rate, burst) = (self.limits.cheap_per_sec, self.limits.cheap_burst);
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(&peer) {
            // Full buckets carry no state: drop them, then the oldest half if that was not enough.
            buckets.retain(|_, b| b.tokens + rate * (now - b.at).as_secs_f64() < burst);
            if buckets.len() >= MAX_BUCKETS {
                let mut ages: Vec<Instant> = buckets.values().map(|b| b.at).collect();
                ages.sort();
                let cut = ages[ages.len() / 2];
                buckets.retain(|_, b| b.at > cut);
            }
        }
        let b = buckets.entry(peer).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        b.tokens = (b.tokens + rate * now.saturating_duration_since(b.at).as_secs_f64()).min(burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cheap_requests_are_limited_per_peer() {
        let limits = PeerLimits::new(ServeLimits {
            cheap_per_sec: 0.001,
            cheap_burst: 3.0,
            ..ServeLimits::default()
        });
        let (p, q) = (PeerId::random(), PeerId::random());
        assert_eq!(
            (0..5).map(|_| limits.allow_cheap(p)).collect::<Vec<_>>(),
            [true, true, true, false, false]
        );
        assert!(limits.allow_cheap(q), "another peer has its own bucket");
    }

    #[test]
    fn a_peer_shares_one_pool_across_its_streams() {
        let limits = PeerLimits::new(ServeLimits::default());
        let p = PeerId::random();
        let (a, _b) = (limits.recv_limits(p), limits.recv_limits(p));
        assert_eq!(a.frame_timeout, Some(Duration::from_secs(60)));
        assert_eq!(limits.pools.lock().unwrap().len(), 1);
        let _q = limits.recv_limits(PeerId::random());
        assert_eq!(limits.pools.lock().unwrap().len(), 2);
    }

    #[test]
    fn limits_that_could_never_pass_a_frame_are_refused() {
        let bad = ServeLimits {
            peer_buffer_bytes: 1024,
            ..ServeLimits::default()
        };
        assert!(bad.validate().is_err());
        assert!(ServeLimits::default().validate().is_ok());
    }
}

//! Admission control: a KV-cache budget in positions, a cap on sessions, and each peer's fair share of both.
//!
//! A session holds a [`Reservation`] of `max_batch x max_length` positions for its whole life; dropping it (close,
//! timeout, disconnect, error) gives the positions back, whatever path ends it.
//!
//! Fairness: a peer may use whatever is free, but once another peer asks for room that is not there, sessions of
//! peers holding more than their fair share (the budget split evenly among the peers holding sessions and the one
//! asking) that have been idle for `reclaim_idle` are evicted, heaviest peer first, least recently used first. An
//! evicted session's positions are free at once; its stream is woken to drop the cache, and answers `EVICTED` when
//! the session is next used (its client opens a new one and replays). A peer at its fair share is never evicted,
//! so a squatter cannot hold the node, and a busy peer is only trimmed while others wait.
use petal_p2p::PeerId;
use petal_proto::pb::ErrorCode;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// What admission allows.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    /// KV cache budget in positions (batch x tokens) of the node's dtype, across all sessions.
    pub cache_tokens: usize,
    /// KV bytes of one position through the span: what a position of the budget costs in memory.
    pub position_bytes: u64,
    pub max_sessions: usize,
    pub max_sessions_per_peer: usize,
    /// A session unused this long may be evicted for a peer below its fair share.
    pub reclaim_idle: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub tokens_used: usize,
    pub tokens_total: usize,
    pub sessions: usize,
}

impl Usage {
    pub fn tokens_free(&self) -> usize {
        self.tokens_total.saturating_sub(self.tokens_used)
    }
}

/// What one peer holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerUsage {
    pub tokens: usize,
    pub sessions: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("server busy: {0} sessions open, the limit")]
    Busy(usize),
    #[error("this peer holds {0} sessions, the per-peer limit")]
    PeerBusy(usize),
    #[error(
        "KV cache full: {asked} positions asked ({}), {free} free ({}) of {total} ({})",
        bytes(*.asked, *.position_bytes), bytes(*.free, *.position_bytes), bytes(*.total, *.position_bytes)
    )]
    CacheFull {
        asked: usize,
        free: usize,
        total: usize,
        /// KV bytes of one position through the span.
        position_bytes: u64,
    },
    #[error("server is shutting down")]
    ShuttingDown,
}

fn bytes(positions: usize, position_bytes: u64) -> String {
    crate::memory::size(positions as u64 * position_bytes)
}

impl Refusal {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Busy(_) | Self::PeerBusy(_) => ErrorCode::Busy,
            Self::CacheFull { .. } => ErrorCode::CacheFull,
            Self::ShuttingDown => ErrorCode::ShuttingDown,
        }
    }

    /// The reason as metrics label it.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Busy(_) => "busy",
            Self::PeerBusy(_) => "peer_busy",
            Self::CacheFull { .. } => "cache_full",
            Self::ShuttingDown => "shutting_down",
        }
    }
}

/// One reservation as admission sees it.
#[derive(Debug)]
struct Held {
    peer: PeerId,
    tokens: usize,
    last_used: Instant,
    evicted: Arc<AtomicBool>,
    /// Wakes the stream holding the session, so it drops an evicted cache at once.
    wake: Arc<Notify>,
}

#[derive(Debug, Default)]
struct Table {
    tokens_used: usize,
    held: HashMap<u64, Held>,
    peers: HashMap<PeerId, PeerUsage>,
    next_id: u64,
    evictions: u64,
}

impl Table {
    fn sessions(&self) -> usize {
        self.held.len()
    }

    fn add(&mut self, peer: PeerId, tokens: usize) {
        let p = self.peers.entry(peer).or_default();
        p.tokens += tokens;
        p.sessions += 1;
        self.tokens_used += tokens;
    }

    fn remove(&mut self, id: u64) -> Option<Held> {
        let held = self.held.remove(&id)?;
        self.tokens_used = self.tokens_used.saturating_sub(held.tokens);
        if let Some(p) = self.peers.get_mut(&held.peer) {
            p.tokens = p.tokens.saturating_sub(held.tokens);
            p.sessions = p.sessions.saturating_sub(1);
            if p.sessions == 0 {
                self.peers.remove(&held.peer);
            }
        }
        Some(held)
    }
}

pub struct Admission {
    limits: AdmissionLimits,
    draining: AtomicBool,
    table: Mutex<Table>,
    changes: watch::Sender<Usage>,
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Arc<Self> {
        let usage = Usage {
            tokens_used: 0,
            tokens_total: limits.cache_tokens,
            sessions: 0,
        };
        Arc::new(Self {
            limits,
            draining: AtomicBool::new(false),
            table: Mutex::new(Table::default()),
            changes: watch::Sender::new(usage),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `tokens` positions of KV cache for a new session of `peer`, evicting idle sessions of peers over
    /// their share if that is what it takes, or says at once why not. `wake` is notified if the session is later
    /// evicted.
    pub fn admit(
        self: &Arc<Self>,
        peer: PeerId,
        tokens: usize,
        wake: &Arc<Notify>,
    ) -> Result<Reservation, Refusal> {
        if self.draining.load(Ordering::Acquire) {
            return Err(Refusal::ShuttingDown);
        }
        let mut t = self.table();
        let own = t.peers.get(&peer).copied().unwrap_or_default();
        if own.sessions >= self.limits.max_sessions_per_peer {
            return Err(Refusal::PeerBusy(own.sessions));
        }
        self.make_room(&mut t, peer, tokens, 1)?;
        let id = t.next_id;
        t.next_id += 1;
        let evicted = Arc::new(AtomicBool::new(false));
        t.add(peer, tokens);
        t.held.insert(
            id,
            Held {
                peer,
                tokens,
                last_used: Instant::now(),
                evicted: evicted.clone(),
                wake: wake.clone(),
            },
        );
        self.publish(&t);
        Ok(Reservation {
            admission: self.clone(),
            id,
            tokens,
            evicted,
        })
    }

    /// Checks that `tokens` more positions and `sessions` more sessions fit for `peer`, evicting what fairness
    /// allows when they do not. Evicts nothing unless that makes them fit.
    fn make_room(
        &self,
        t: &mut Table,
        peer: PeerId,
        tokens: usize,
        sessions: usize,
    ) -> Result<(), Refusal> {
        let total = self.limits.cache_tokens;
        let fits = |t: &Table| {
            t.sessions() + sessions <= self.limits.max_sessions && t.tokens_used + tokens <= total
        };
        if fits(t) {
            return Ok(());
        }
        let refusal = |t: &Table| {
            if t.sessions() + sessions > self.limits.max_sessions {
                Refusal::Busy(t.sessions())
            } else {
                Refusal::CacheFull {
                    asked: tokens,
                    free: total.saturating_sub(t.tokens_used),
                    total,
                    position_bytes: self.limits.position_bytes,
                }
            }
        };
        // Fair shares: the budget split among the peers holding sessions and the one asking.
        let peers = t.peers.len() + usize::from(!t.peers.contains_key(&peer));
        let share_tokens = total / peers.max(1);
        let share_sessions = (self.limits.max_sessions / peers.max(1)).max(1);
        let own = t.peers.get(&peer).copied().unwrap_or_default();
        if own.tokens + tokens > share_tokens || own.sessions + sessions > share_sessions {
            // Asking beyond its own share: only free room will do.
            return Err(refusal(t));
        }
        // Plan: evict from the heaviest peer over its share, its least recently used idle session first.
        let now = Instant::now();
        let mut usage: HashMap<PeerId, PeerUsage> = t.peers.clone();
        let mut idle: Vec<(u64, PeerId, usize, Instant)> = t
            .held
            .iter()
            .filter(|(_, h)| h.peer != peer && now - h.last_used >= self.limits.reclaim_idle)
            .map(|(id, h)| (*id, h.peer, h.tokens, h.last_used))
            .collect();
        idle.sort_by_key(|(_, _, _, used)| *used);
        let (mut freed_tokens, mut freed_sessions, mut plan) = (0usize, 0usize, vec![]);
        let over = |u: &PeerUsage| u.tokens > share_tokens || u.sessions > share_sessions;
        while !(t.sessions() - freed_sessions + sessions <= self.limits.max_sessions
            && t.tokens_used - freed_tokens + tokens <= total)
        {
            let heaviest = usage
                .iter()
                .filter(|(p, u)| **p != peer && over(u))
                .filter(|(p, _)| idle.iter().any(|(_, q, _, _)| q == *p))
                .max_by_key(|(_, u)| u.tokens)
                .map(|(p, _)| *p);
            let Some(victim) = heaviest else {
                return Err(refusal(t));
            };
            let Some(at) = idle.iter().position(|(_, q, _, _)| *q == victim) else {
                return Err(refusal(t));
            };
            let (id, _, held_tokens, _) = idle.remove(at);
            if let Some(u) = usage.get_mut(&victim) {
                u.tokens = u.tokens.saturating_sub(held_tokens);
                u.sessions = u.sessions.saturating_sub(1);
            }
            freed_tokens += held_tokens;
            freed_sessions += 1;
            plan.push(id);
        }
        for id in plan {
            if let Some(h) = t.remove(id) {
                tracing::info!(victim = %h.peer, tokens = h.tokens, idle_s = h.last_used.elapsed().as_secs_f64(), %peer, "evicting an idle session over its peer's fair share");
                h.evicted.store(true, Ordering::Release);
                h.wake.notify_one();
                t.evictions += 1;
            }
        }
        debug_assert!(fits(t));
        Ok(())
    }

    /// Refuses every new session from now on (SIGTERM); running ones continue.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn usage(&self) -> Usage {
        self.usage_of(&self.table())
    }

    fn usage_of(&self, t: &Table) -> Usage {
        Usage {
            tokens_used: t.tokens_used,
            tokens_total: self.limits.cache_tokens,
            sessions: t.sessions(),
        }
    }

    /// What each peer holding sessions holds.
    pub fn peers(&self) -> Vec<(PeerId, PeerUsage)> {
        self.table().peers.iter().map(|(p, u)| (*p, *u)).collect()
    }

    /// Sessions evicted for other peers since start.
    pub fn evictions(&self) -> u64 {
        self.table().evictions
    }

    /// Usage changes, for the DHT record and metrics.
    pub fn subscribe(&self) -> watch::Receiver<Usage> {
        self.changes.subscribe()
    }

    fn publish(&self, t: &Table) {
        self.changes.send_replace(self.usage_of(t));
    }

    fn release(&self, id: u64) {
        let mut t = self.table();
        if t.remove(id).is_some() {
            self.publish(&t);
        }
    }
}

/// A session's claim on the cache budget, released on drop.
#[derive(Debug)]
pub struct Reservation {
    admission: Arc<Admission>,
    id: u64,
    tokens: usize,
    evicted: Arc<AtomicBool>,
}

impl Reservation {
    /// Positions reserved.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Whether admission took the positions back for another peer: the session must be dropped.
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Marks the session as used now (idle sessions are the ones fairness may evict).
    pub fn touch(&self) {
        if let Some(h) = self.admission.table().held.get_mut(&self.id) {
            h.last_used = Instant::now();
        }
    }

    /// Grows the reservation to `tokens` positions (a session extended), with the same rules as a new session's.
    pub fn grow_to(&mut self, tokens: usize) -> Result<(), Refusal> {
        if tokens <= self.tokens {
            return Ok(());
        }
        let extra = tokens - self.tokens;
        let admission = self.admission.clone();
        let mut t = admission.table();
        let Some(peer) = t.held.get(&self.id).map(|h| h.peer) else {
            return Err(Refusal::CacheFull {
                asked: extra,
                free: 0,
                total: admission.limits.cache_tokens,
                position_bytes: admission.limits.position_bytes,
            });
        };
        admission.make_room(&mut t, peer, extra, 0)?;
        // make_room never evicts the asking peer's own sessions, so this one is still held.
        if let Some(h) = t.held.get_mut(&self.id) {
            h.tokens = tokens;
            h.last_used = Instant::now();
        }
        t.tokens_used += extra;
        if let Some(p) = t.peers.get_mut(&peer) {
            p.tokens += extra;
        }
        self.tokens = tokens;
        admission.publish(&t);
        Ok(())
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("usage", &self.usage())
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.admission.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(cache_tokens: usize, max_sessions: usize) -> AdmissionLimits {
        AdmissionLimits {
            cache_tokens,
            position_bytes: 1 << 17,
            max_sessions,
            max_sessions_per_peer: usize::MAX,
            reclaim_idle: Duration::ZERO,
        }
    }

    fn wake() -> Arc<Notify> {
        Arc::new(Notify::new())
    }

    #[test]
    fn budget_is_enforced_and_released() {
        let a = Admission::new(limits(100, 3));
        let p = PeerId::random();
        let r1 = a.admit(p, 40, &wake()).unwrap();
        let _r2 = a.admit(p, 40, &wake()).unwrap();
        assert_eq!(
            a.admit(p, 40, &wake()).unwrap_err(),
            Refusal::CacheFull {
                asked: 40,
                free: 20,
                total: 100,
                position_bytes: 1 << 17,
            }
        );
        // In bytes too: a position of 128 KiB (the 8B shape's, in f16).
        assert_eq!(
            a.admit(p, 40, &wake()).unwrap_err().to_string(),
            "KV cache full: 40 positions asked (5.0 MiB), 20 free (2.5 MiB) of 100 (12.5 MiB)"
        );
        drop(r1);
        let _r3 = a.admit(p, 40, &wake()).unwrap();
        assert_eq!(a.usage().sessions, 2);
        let _r4 = a.admit(p, 10, &wake()).unwrap();
        assert_eq!(a.admit(p, 1, &wake()).unwrap_err(), Refusal::Busy(3));
    }

    #[test]
    fn draining_refuses_new_sessions() {
        let a = Admission::new(limits(100, 3));
        let p = PeerId::random();
        let r = a.admit(p, 10, &wake()).unwrap();
        a.drain();
        assert_eq!(a.admit(p, 1, &wake()).unwrap_err(), Refusal::ShuttingDown);
        drop(r);
        assert_eq!(a.usage().tokens_used, 0);
    }

    #[test]
    fn per_peer_session_cap() {
        let a = Admission::new(AdmissionLimits {
            max_sessions_per_peer: 2,
            ..limits(100, 10)
        });
        let (p, q) = (PeerId::random(), PeerId::random());
        let _r = [
            a.admit(p, 1, &wake()).unwrap(),
            a.admit(p, 1, &wake()).unwrap(),
        ];
        assert_eq!(a.admit(p, 1, &wake()).unwrap_err(), Refusal::PeerBusy(2));
        assert!(a.admit(q, 1, &wake()).is_ok());
    }

    #[test]
    fn a_squatter_over_its_share_is_evicted_lru_first_for_a_newcomer() {
        let a = Admission::new(limits(100, 10));
        let (squatter, newcomer) = (PeerId::random(), PeerId::random());
        let squatter_wake = wake();
        let held: Vec<Reservation> = (0..4)
            .map(|_| a.admit(squatter, 25, &squatter_wake).unwrap())
            .collect();
        held[0].touch(); // the most recently used: evicted last
        let r = a.admit(newcomer, 40, &wake()).unwrap();
        // Two of the squatter's sessions went (25 each for 40), the least recently used ones.
        let evicted: Vec<bool> = held.iter().map(Reservation::is_evicted).collect();
        assert_eq!(evicted, [false, true, true, false]);
        assert_eq!(a.usage().tokens_used, 50 + 40);
        assert_eq!(a.evictions(), 2);
        // At its share (50 of 100 between two peers), the squatter is safe: the newcomer cannot take more.
        assert!(matches!(
            a.admit(newcomer, 20, &wake()),
            Err(Refusal::CacheFull { .. })
        ));
        // Evicted reservations do not give their positions back twice.
        drop(held);
        assert_eq!(a.usage().tokens_used, 40);
        drop(r);
        assert_eq!(
            a.usage(),
            Usage {
                tokens_used: 0,
                tokens_total: 100,
                sessions: 0
            }
        );
        assert!(a.peers().is_empty());
    }

    #[test]
    fn sessions_in_use_are_not_evicted() {
        let a = Admission::new(AdmissionLimits {
            reclaim_idle: Duration::from_secs(3600),
            ..limits(100, 10)
        });
        let (busy, newcomer) = (PeerId::random(), PeerId::random());
        let _held = a.admit(busy, 100, &wake()).unwrap();
        assert!(matches!(
            a.admit(newcomer, 10, &wake()),
            Err(Refusal::CacheFull { .. })
        ));
    }

    #[test]
    fn growing_follows_the_same_rules() {
        let a = Admission::new(limits(100, 10));
        let (p, q) = (PeerId::random(), PeerId::random());
        let mut r = a.admit(p, 10, &wake()).unwrap();
        r.grow_to(60).unwrap();
        assert_eq!((r.tokens(), a.usage().tokens_used), (60, 60));
        let q_wake = wake();
        let _q = a.admit(q, 40, &q_wake).unwrap();
        // p is at 60 of its share of 50: it may only use free room, and there is none.
        assert!(matches!(r.grow_to(70), Err(Refusal::CacheFull { .. })));
        assert_eq!(a.usage().tokens_used, 100);
        drop(r);
        assert_eq!(a.usage().tokens_used, 40);
    }
}

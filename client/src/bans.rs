//! Which servers failed this client, and for how long they sit out: each failure doubles the time (from
//! [`BAN_BASE`] up to [`BAN_MAX`]), and failures are forgotten one per [`STRIKE_MEMORY`] without a new one, so a
//! server that had a blip is back within seconds and one that keeps failing stays out for minutes.
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long a server sits out after its first failure.
pub const BAN_BASE: Duration = Duration::from_secs(5);
/// The longest a server sits out, however often it failed.
pub const BAN_MAX: Duration = Duration::from_secs(10 * 60);
/// How long one failure is remembered for the doubling.
pub const STRIKE_MEMORY: Duration = Duration::from_secs(10 * 60);

#[derive(Debug, Clone, Copy)]
struct Strikes {
    count: u32,
    last: Instant,
    until: Instant,
}

/// Decaying bans, keyed by peer id.
#[derive(Debug, Default)]
pub struct Bans {
    peers: HashMap<String, Strikes>,
}

impl Bans {
    /// Records a failure of `peer` at `now` and returns how long it sits out.
    pub fn strike(&mut self, peer: &str, now: Instant) -> Duration {
        let count = self.peers.get(peer).map_or(0, |s| decayed(s, now)) + 1;
        let ban = BAN_BASE
            .saturating_mul(1u32 << (count - 1).min(16))
            .min(BAN_MAX);
        self.peers.insert(
            peer.to_string(),
            Strikes {
                count,
                last: now,
                until: now + ban,
            },
        );
        ban
    }

    /// Bans `peer` for [`BAN_MAX`] at `now`: it was caught giving wrong answers. It is remembered as enough
    /// failures that another one, even after a strike has decayed, draws [`BAN_MAX`] again.
    pub fn convict(&mut self, peer: &str, now: Instant) -> Duration {
        let count = (BAN_MAX.as_secs() / BAN_BASE.as_secs()).ilog2() + 2;
        self.peers.insert(
            peer.to_string(),
            Strikes {
                count,
                last: now,
                until: now + BAN_MAX,
            },
        );
        BAN_MAX
    }

    /// Peers with a failure still remembered at `now` (sitting out or not).
    pub fn suspects(&mut self, now: Instant) -> HashSet<String> {
        self.forget_decayed(now);
        self.peers.keys().cloned().collect()
    }

    /// Peers sitting out at `now`; forgets those whose failures have all decayed.
    pub fn banned(&mut self, now: Instant) -> HashSet<String> {
        self.forget_decayed(now);
        self.peers
            .iter()
            .filter(|(_, s)| s.until > now)
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Drops peers out of their ban whose failures have all decayed by `now`.
    fn forget_decayed(&mut self, now: Instant) {
        self.peers
            .retain(|_, s| s.until > now || decayed(s, now) > 0);
    }
}

/// Failures still remembered at `now`.
fn decayed(s: &Strikes, now: Instant) -> u32 {
    let forgotten = now.saturating_duration_since(s.last).as_secs() / STRIKE_MEMORY.as_secs();
    s.count
        .saturating_sub(forgotten.min(u32::MAX as u64) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bans_double_and_decay() {
        let mut bans = Bans::default();
        let t0 = Instant::now();
        assert_eq!(bans.strike("a", t0), BAN_BASE);
        assert!(bans.banned(t0).contains("a"));
        assert!(!bans.banned(t0 + BAN_BASE).contains("a"));
        assert_eq!(bans.strike("a", t0 + BAN_BASE), BAN_BASE * 2);
        assert_eq!(bans.strike("a", t0 + BAN_BASE * 3), BAN_BASE * 4);
        // Many failures: capped.
        let mut t = t0;
        for _ in 0..20 {
            t += Duration::from_secs(1);
            bans.strike("b", t);
        }
        assert_eq!(bans.strike("b", t), BAN_MAX);
        // A quiet spell forgets failures one by one: after three, `a` (three strikes) starts over.
        let later = t0 + BAN_BASE * 3 + STRIKE_MEMORY * 3;
        assert!(bans.banned(later).is_empty() || !bans.banned(later).contains("a"));
        assert_eq!(bans.strike("a", later), BAN_BASE);
        // A convicted liar sits out the longest ban at once, and a failure soon after keeps it there.
        assert_eq!(bans.convict("liar", t0), BAN_MAX);
        assert!(bans.banned(t0 + BAN_MAX / 2).contains("liar"));
        assert!(!bans.banned(t0 + BAN_MAX).contains("liar"));
        assert_eq!(bans.strike("liar", t0 + BAN_MAX), BAN_MAX);
        // Out of its ban, a peer that failed is still a suspect until its failures are forgotten.
        let mut bans = Bans::default();
        bans.strike("blip", t0);
        assert!(!bans.banned(t0 + BAN_BASE).contains("blip"));
        assert!(bans.suspects(t0 + BAN_BASE).contains("blip"));
        assert!(!bans
            .suspects(t0 + BAN_BASE + STRIKE_MEMORY)
            .contains("blip"));
    }
}

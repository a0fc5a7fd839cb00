//! When a batch should wait for more callers: the policy the span scheduler and the LM head's row batcher share.
//!
//! Callers that shared a batch tend to come back together (a node answers its batched sessions at once), but not at
//! the same instant. A batch run as soon as the first of them is back would read the weights for its rows alone,
//! and the rest would pay for another pass a moment later. So a batch about to run waits for the callers of the last
//! two batches that have not queued yet, for at most a share of the last batch's compute time (capped); those still
//! missing then are forgotten, so a caller that left costs at most one wait.
//!
//! [`Gathering`] holds only the policy and its memory; each batcher waits in its own way (a channel, a condvar).
use std::time::Duration;

/// The longest a batch waits, as a share of the last batch's compute time: waiting never costs more than half a
/// batch.
const SHARE: f64 = 0.5;

/// Who ran in the last batches, and how long the last one took; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Gathering {
    /// The most a wait lasts, whatever the last batch took.
    cap: Duration,
    /// A fixed limit instead of the share of the last batch (tests, or `Duration::ZERO`: never wait).
    fixed: Option<Duration>,
    /// The callers of the last two batches, the last first.
    recent: [Vec<u64>; 2],
    last_compute: Option<Duration>,
}

impl Gathering {
    /// Waits of at most half the last batch's compute time and at most `cap`, or always `fixed` when given.
    pub fn new(cap: Duration, fixed: Option<Duration>) -> Self {
        Self {
            cap,
            fixed,
            recent: [Vec::new(), Vec::new()],
            last_compute: None,
        }
    }

    /// The longest the next batch waits.
    pub fn limit(&self) -> Duration {
        self.fixed.unwrap_or_else(|| {
            self.last_compute
                .unwrap_or_default()
                .mul_f64(SHARE)
                .min(self.cap)
        })
    }

    /// Whether a caller of the last two batches is not among `queued`.
    pub fn missing(&self, queued: &[u64]) -> bool {
        self.recent.iter().flatten().any(|c| !queued.contains(c))
    }

    /// Whether the last two batches had one caller between them (or none): the next batch then waits for nobody
    /// but whoever starts it.
    pub fn one_caller(&self) -> bool {
        let mut callers = self.recent.iter().flatten();
        match callers.next() {
            None => true,
            Some(first) => callers.all(|c| c == first),
        }
    }

    /// Forgets the callers of the last batches that are not among `queued` (the wait is over).
    pub fn forget_missing(&mut self, queued: &[u64]) {
        for callers in &mut self.recent {
            callers.retain(|c| queued.contains(c));
        }
    }

    /// Records a batch run: its callers and how long it computed.
    pub fn ran(&mut self, callers: Vec<u64>, compute: Duration) {
        self.recent.swap(0, 1);
        self.recent[0] = callers;
        self.last_compute = Some(compute);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_the_last_two_batches_and_forgets_who_stayed_away() {
        let mut g = Gathering::new(Duration::from_millis(5), None);
        assert!(!g.missing(&[]), "nobody ran yet");
        g.ran(vec![1, 2], Duration::ZERO);
        g.ran(vec![3], Duration::ZERO);
        assert!(g.missing(&[1, 3]));
        assert!(!g.missing(&[3, 2, 1]));
        g.forget_missing(&[1, 3]);
        assert!(!g.missing(&[1, 3]));
        // A third batch pushes the oldest out.
        g.ran(vec![4], Duration::ZERO);
        assert!(!g.missing(&[4, 3]));
    }

    #[test]
    fn one_caller_means_one_across_the_last_two_batches() {
        let mut g = Gathering::new(Duration::from_millis(5), None);
        assert!(g.one_caller(), "no batch yet");
        g.ran(vec![7], Duration::from_millis(1));
        g.ran(vec![7], Duration::from_millis(1));
        assert!(g.one_caller());
        g.ran(vec![8], Duration::from_millis(1));
        assert!(!g.one_caller(), "7 and 8 in the last two");
        g.ran(vec![8], Duration::from_millis(1));
        assert!(g.one_caller());
        g.ran(vec![8, 9], Duration::from_millis(1));
        assert!(!g.one_caller());
    }

    #[test]
    fn the_limit_is_half_the_last_compute_capped_or_fixed() {
        let mut g = Gathering::new(Duration::from_millis(5), None);
        assert_eq!(g.limit(), Duration::ZERO);
        g.ran(vec![], Duration::from_millis(4));
        assert_eq!(g.limit(), Duration::from_millis(2));
        g.ran(vec![], Duration::from_secs(1));
        assert_eq!(g.limit(), Duration::from_millis(5));
        let mut fixed = Gathering::new(Duration::from_millis(5), Some(Duration::from_secs(60)));
        fixed.ran(vec![], Duration::from_millis(4));
        assert_eq!(fixed.limit(), Duration::from_secs(60));
    }
}

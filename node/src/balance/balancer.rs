//! When a node looks at the swarm again and whether it may move then: jittered checks and hysteresis around the
//! decisions of [`super::plan`]. Time is passed in (a `Duration` since any origin), so the swarm simulation in the
//! tests drives the very same policy with a simulated clock.
use super::plan::{self, Gain};
use petal_model::BlockRange;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

/// `--balance-period` and `--balance-quality`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalanceConfig {
    /// Checks come at random intervals between half of this and all of it, so nodes that joined together do not
    /// look (and move) together, and a gap is seen by some node within one period.
    pub period: Duration,
    /// A move for speed must raise the swarm's slowest block by more than this factor (> 1). Moves that fill a
    /// gap need no factor.
    pub quality: f64,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        Self {
            period: Duration::from_secs(120),
            quality: 1.25,
        }
    }
}

/// After a move, a node moves again for speed only after this many periods (it may still move to fill a gap):
/// with the quality factor, the hysteresis that keeps nodes from trading places back and forth.
pub const COOLDOWN_PERIODS: u32 = 3;

/// One node's balancing policy and the state it keeps between checks.
#[derive(Debug)]
pub struct Balancer {
    config: BalanceConfig,
    rng: StdRng,
    last_move: Option<Duration>,
}

impl Balancer {
    /// A policy whose jitter comes from `seed` (a node seeds it from its peer id, the simulation from its own).
    pub fn new(config: BalanceConfig, seed: u64) -> Self {
        Self {
            config,
            rng: StdRng::seed_from_u64(seed),
            last_move: None,
        }
    }

    pub fn config(&self) -> &BalanceConfig {
        &self.config
    }

    /// How long until the next check: uniform in [period / 2, period].
    pub fn next_check(&mut self) -> Duration {
        let period = self.config.period.as_secs_f64();
        Duration::from_secs_f64(self.rng.random_range(period / 2.0..=period))
    }

    /// At `now`, where a node serving `current` at `own` tokens per second should go, given the other servers'
    /// per-block throughput `others` ([`plan::block_throughputs`] without itself); `None`: stay.
    pub fn decide(
        &self,
        now: Duration,
        others: &[f64],
        current: BlockRange,
        own: f64,
    ) -> Option<(BlockRange, Gain)> {
        let (target, gain) = plan::should_move(others, current, own, self.config.quality)?;
        let cooling = self
            .last_move
            .is_some_and(|at| now < at + self.config.period * COOLDOWN_PERIODS);
        if cooling && matches!(gain, Gain::Throughput { .. }) {
            return None;
        }
        Some((target, gain))
    }

    /// Whether a move decided earlier is still worth making now that the new span is loaded: other servers may
    /// have moved meanwhile (into the same gap, or out of the blocks this one would leave).
    pub fn still_worth(
        &self,
        others: &[f64],
        current: BlockRange,
        target: BlockRange,
        own: f64,
    ) -> bool {
        plan::move_gain(others, current, target, own, self.config.quality).is_some()
    }

    /// The node moved at `now`.
    pub fn moved(&mut self, now: Duration) {
        self.last_move = Some(now);
    }
}

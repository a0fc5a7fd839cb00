//! The report's figures: medians over runs ([`Summary`]), one chain length's entry ([`Chain`]), and the
//! statistics helpers every part of the bench uses.
use crate::runs::Run;
use petal_model::BlockRange;
use serde_json::{json, Value};
use std::time::Duration;

/// Medians over repeats.
pub struct Summary {
    pub tokens_per_second: f64,
    pub ms_per_token: f64,
    runs: Vec<f64>,
    first_token_ms: f64,
    /// Per decode step: the blocks (locally) or the chain (through a swarm), and the head's share.
    blocks_ms: f64,
    head_ms: f64,
}

impl Summary {
    pub fn of(runs: &[Run]) -> Self {
        let tps: Vec<f64> = runs.iter().map(|r| r.tokens_per_second).collect();
        let tokens_per_second = median(&tps);
        let of = |f: fn(&Run) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        Self {
            tokens_per_second,
            ms_per_token: 1e3 / tokens_per_second.max(1e-9),
            runs: tps,
            first_token_ms: of(|r| r.first_token_ms),
            blocks_ms: of(|r| r.blocks_ms),
            head_ms: of(|r| r.head_ms),
        }
    }

    /// The `local` entry of the report.
    pub fn to_json(&self) -> Value {
        json!({
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ms_per_token": round(self.ms_per_token, 3),
            "runs_tokens_per_second": self.runs_json(),
            "first_token_ms": round(self.first_token_ms, 1),
            "blocks_ms_per_token": round(self.blocks_ms, 3),
            "head_ms_per_token": round(self.head_ms, 3),
        })
    }

    fn runs_json(&self) -> Vec<f64> {
        self.runs.iter().map(|&t| round(t, 2)).collect()
    }
}

/// One chain length's results.
pub struct Chain {
    pub nodes: usize,
    pub spans: Vec<BlockRange>,
    pub startup_seconds: f64,
    pub runs: Vec<Run>,
    /// Local runs alternated with the swarm runs (small models only).
    pub paired_local: Vec<Run>,
    pub new_tokens: usize,
    /// Load averages when the chain started: the machine is shared, so each figure carries its own.
    pub load_avg: Value,
    /// Per-hop round trip against server compute, from [`crate::probe::probe_chain`].
    pub probe: Value,
}

impl Chain {
    /// The chain's figures, relative to the paired local runs when there are some, else to the local phase.
    pub fn to_json(&self, local: &Summary, local_runs: &[Run]) -> Value {
        let s = Summary::of(&self.runs);
        let paired = (!self.paired_local.is_empty()).then(|| Summary::of(&self.paired_local));
        let base = paired.as_ref().unwrap_or(local);
        let reference = local_runs
            .first()
            .map(|r| r.tokens.as_slice())
            .unwrap_or(&[]);
        let tokens_match = self
            .runs
            .iter()
            .chain(&self.paired_local)
            .all(|r| r.tokens == reference);
        let bytes: Vec<f64> = self.runs.iter().map(|r| r.bytes_on_wire as f64).collect();
        let per_hop = |ms: f64| round(ms / self.nodes as f64, 3);
        json!({
            "nodes": self.nodes,
            "spans": self.spans.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "route": self.runs.first().map(|r| r.route.clone()).unwrap_or_default(),
            "startup_seconds": round(self.startup_seconds, 2),
            "tokens_per_second": round(s.tokens_per_second, 2),
            "ms_per_token": round(s.ms_per_token, 3),
            "runs_tokens_per_second": s.runs_json(),
            "first_token_ms": round(s.first_token_ms, 1),
            "local_paired": paired.is_some(),
            "local_tokens_per_second": round(base.tokens_per_second, 2),
            "ratio_to_local": round(s.tokens_per_second / base.tokens_per_second.max(1e-9), 3),
            "added_ms_per_hop": per_hop(s.ms_per_token - base.ms_per_token),
            "bytes_per_token": round(median(&bytes) / self.new_tokens.max(1) as f64, 1),
            "tokens_match": tokens_match,
            "load_avg": self.load_avg,
            "probe": self.probe,
            // Client-side view of a decode step: the head, and the chain's round trips (server compute included).
            "head_ms_per_token": round(s.head_ms, 3),
            "chain_ms_per_token": round(s.blocks_ms, 3),
            "added_ms_per_hop_in_chain": per_hop(s.blocks_ms - base.blocks_ms),
        })
    }
}

pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    }
}

fn to_ms(durations: &[Duration]) -> Vec<f64> {
    durations.iter().map(|d| d.as_secs_f64() * 1e3).collect()
}

/// The `q` quantile (0..=1, nearest rank) of `durations`, in ms.
pub fn percentile_ms(durations: &[Duration], q: f64) -> f64 {
    let mut v = to_ms(durations);
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    v[rank]
}

pub fn mean_ms(durations: &[Duration]) -> f64 {
    if durations.is_empty() {
        return 0.0;
    }
    to_ms(durations).iter().sum::<f64>() / durations.len() as f64
}

pub fn median_ms(durations: &[Duration]) -> f64 {
    median(&to_ms(durations))
}

/// `v` rounded to `digits` decimals, so the JSON stays readable.
pub fn round(v: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (v * p).round() / p
}

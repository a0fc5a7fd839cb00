//! The per-hop probe: decode steps sent through the chain hop by hop, each hop through its own
//! [`petal_client::HopClient`], so every hop's round trip can be set against the compute time its server reports.
use crate::model::{prompt_ids, Bench};
use crate::report::{mean_ms, median, median_ms, percentile_ms, round};
use crate::runs::{chain_config, Local};
use anyhow::Result;
use candle_core::{DType, Tensor};
use petal_client::blocks::LocalSpansSession;
use petal_client::generator::compute;
use petal_client::{Generator, HopClient, SwarmClient};
use petal_model::{BlockRange, Head};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Decode steps through the chain hop by hop, to split each hop's round trip into what the server reports as
/// compute (`StepResult.compute_micros`: its blocks, including the hand-off to the blocking pool) and the rest
/// (serialisation at both ends, libp2p, task wake-ups), which a chain session only sums per step. With `local`,
/// every step also runs through the local blocks on the same input just before, so the swarm's added time is
/// measured step by step, milliseconds apart, and load bursts on a shared machine hit both alike.
pub async fn probe_chain(
    bench: &Bench,
    remote: &Generator,
    client: &SwarmClient,
    local: Option<&Local>,
    steps: usize,
) -> Result<Value> {
    let config = chain_config();
    let spec = bench.source.spec();
    let route = client
        .plan(
            remote.model_id(),
            BlockRange::new(0, spec.num_blocks),
            config.discovery_timeout,
        )
        .await?;
    let mut hops = vec![];
    for hop in &route {
        // A hop left open when a later one fails is freed by its server when the stream drops.
        let opened = HopClient::open(
            client.network(),
            remote.model_id(),
            hop.clone(),
            steps,
            config.step_timeout,
        );
        hops.push(opened.await?);
    }
    let mut local = local.map(|l| l.spans.open_local(steps)).transpose()?;
    let ids = prompt_ids(steps, spec.vocab_size);
    let probe = Probe {
        head: remote.head(),
        timeout: config.step_timeout,
    };
    let times = probe.steps(&mut hops, local.as_mut(), &ids).await;
    for hop in hops {
        hop.close(config.step_timeout).await;
    }
    Ok(times?.to_json(steps, route.len()))
}

/// The client's side of the probe: its head and the hops' step timeout.
struct Probe<'a> {
    head: &'a Head,
    timeout: Duration,
}

impl Probe<'_> {
    /// One decode step per id of `ids`, at positions 0, 1, ...
    async fn steps(
        &self,
        hops: &mut [HopClient],
        mut local: Option<&mut LocalSpansSession>,
        ids: &[u32],
    ) -> Result<ProbeTimes> {
        let mut times = ProbeTimes::default();
        for (position, &id) in ids.iter().enumerate() {
            // The first steps (two, when there are more) warm up caches and connections.
            times.recording = position >= 2.min(ids.len() - 1);
            let t0 = Instant::now();
            let x = compute(|| self.head.embed(&[id]))?;
            let embed = t0.elapsed();
            let local_out = match local.as_deref_mut() {
                Some(session) => {
                    let t = Instant::now();
                    let y = compute(|| session.forward_now(&x))?;
                    Some((y, t.elapsed()))
                }
                None => None,
            };
            let t1 = Instant::now();
            let mut y = x;
            for hop in hops.iter_mut() {
                let step = hop.step(&y, position, self.timeout).await?;
                times.hop(step.round_trip, step.compute);
                y = step.hidden;
            }
            let chain = t1.elapsed();
            let t2 = Instant::now();
            // The head's work of a greedy step: LM head and argmax (the probe feeds its own ids, not this one).
            compute(|| petal_model::text::greedy::argmax(&self.head.logits(&y)?))?;
            times.step(chain, embed + t2.elapsed(), local_out, &y)?;
        }
        Ok(times)
    }
}

/// What [`probe_chain`] records, per hop and per step.
#[derive(Default)]
struct ProbeTimes {
    recording: bool,
    hop_round_trips: Vec<Duration>,
    hop_computes: Vec<Duration>,
    hop_overheads: Vec<Duration>,
    chain: Vec<Duration>,
    head: Vec<Duration>,
    local: Vec<Duration>,
    /// Per step: chain time minus local blocks time, in ms (negative when the chain was faster).
    added: Vec<f64>,
    /// Largest difference between the chain's and the local blocks' outputs.
    max_abs_diff: f32,
}

impl ProbeTimes {
    fn hop(&mut self, round_trip: Duration, compute: Duration) {
        if self.recording {
            self.hop_round_trips.push(round_trip);
            self.hop_computes.push(compute);
            self.hop_overheads.push(round_trip.saturating_sub(compute));
        }
    }

    fn step(
        &mut self,
        chain: Duration,
        head: Duration,
        local: Option<(Tensor, Duration)>,
        chain_out: &Tensor,
    ) -> Result<()> {
        if let Some((local_out, _)) = &local {
            // The chain's output comes off the wire on the CPU; the local blocks' may be on a GPU.
            let on_cpu = |t: &Tensor| t.to_device(&candle_core::Device::Cpu)?.to_dtype(DType::F32);
            let diff = (on_cpu(local_out)? - on_cpu(chain_out)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            self.max_abs_diff = self.max_abs_diff.max(diff);
        }
        if self.recording {
            self.chain.push(chain);
            self.head.push(head);
            if let Some((_, l)) = local {
                self.local.push(l);
                self.added
                    .push((chain.as_secs_f64() - l.as_secs_f64()) * 1e3);
            }
        }
        Ok(())
    }

    fn to_json(&self, steps: usize, hops: usize) -> Value {
        let mut v = json!({
            "steps": steps,
            "hop_round_trip_ms": round(median_ms(&self.hop_round_trips), 3),
            "server_compute_ms": round(median_ms(&self.hop_computes), 3),
            "overhead_ms_per_hop": round(median_ms(&self.hop_overheads), 3),
            "overhead_ms_per_hop_p90": round(percentile_ms(&self.hop_overheads, 0.9), 3),
            "overhead_ms_per_hop_mean": round(mean_ms(&self.hop_overheads), 3),
            "chain_ms": round(median_ms(&self.chain), 3),
            "head_ms": round(median_ms(&self.head), 3),
        });
        if !self.local.is_empty() {
            let (chain, head, local) = (
                median_ms(&self.chain),
                median_ms(&self.head),
                median_ms(&self.local),
            );
            v["local_blocks_ms"] = json!(round(local, 3));
            let per_hop = |v: f64| json!(round(v / hops.max(1) as f64, 3));
            v["added_ms_per_hop"] = per_hop(median(&self.added));
            v["added_ms_per_hop_mean"] =
                per_hop(self.added.iter().sum::<f64>() / self.added.len() as f64);
            v["step_ratio_to_local"] = json!(round((head + local) / (head + chain).max(1e-9), 3));
            v["max_abs_diff"] = json!(self.max_abs_diff);
        }
        v
    }
}

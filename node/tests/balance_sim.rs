//! A simulated swarm, 10 minutes on an injected clock: nodes join (choosing their blocks as `petal-node serve
//! --num-blocks` does) and leave at random, and every node runs the real balancing policy. Checked: no block stays
//! uncovered longer than one balance period (plus the time to see the gap and load the new span) while enough nodes
//! exist to cover the model, and no node moves more than a few times.
use petal_model::BlockRange;
use petal_node::balance::balancer::{BalanceConfig, Balancer};
use petal_node::balance::plan;
use petal_proto::pb::ServerRecord;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

const NUM_BLOCKS: usize = 30;
const PERIOD: f64 = 60.0;
/// Seconds for an announcement to reach the others (DHT put, then their lookups).
const PROPAGATION: f64 = 2.0;
/// Seconds to load a span before serving it.
const LOAD: f64 = 3.0;
const TICK: f64 = 0.5;
const DURATION: f64 = 600.0;
/// A node moves at most this many times in the 10 minutes.
const MAX_MOVES: u32 = 3;

struct SimNode {
    id: String,
    throughput: f64,
    /// Served now; `None` while the first span loads.
    range: Option<BlockRange>,
    /// (time, announced range): what the others see PROPAGATION later; `None` once gone.
    announcements: Vec<(f64, Option<BlockRange>)>,
    balancer: Balancer,
    next_check: f64,
    /// A span loading: (target, ready at).
    pending: Option<(BlockRange, f64)>,
    moves: u32,
    alive: bool,
}

impl SimNode {
    /// The range the others see at `t`.
    fn seen_at(&self, t: f64) -> Option<BlockRange> {
        self.announcements
            .iter()
            .rev()
            .find(|(at, _)| at + PROPAGATION <= t)
            .and_then(|(_, r)| *r)
    }
}

/// The records node `me` (or a joining node, `None`) can see at `t`.
fn view(nodes: &[SimNode], me: Option<usize>, t: f64) -> Vec<ServerRecord> {
    nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != me)
        .filter_map(|(_, n)| {
            let r = n.seen_at(t)?;
            Some(ServerRecord {
                peer_id: n.id.clone(),
                start_block: r.start as u32,
                end_block: r.end as u32,
                throughput_tokens_per_sec: n.throughput as f32,
                ..Default::default()
            })
        })
        .collect()
}

fn secs(t: f64) -> Duration {
    Duration::from_secs_f64(t)
}

struct Outcome {
    longest_gap: f64,
    most_moves: u32,
    joins: usize,
    leaves: usize,
}

fn simulate(seed: u64, lens: &[usize]) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let config = BalanceConfig {
        period: secs(PERIOD),
        quality: 1.25,
    };
    let mut nodes: Vec<SimNode> = vec![];
    // Enough to cover the model with one spare whatever the spans' lengths.
    let enough = NUM_BLOCKS.div_ceil(*lens.iter().min().expect("lengths")) + 1;
    let (mut joins, mut leaves) = (0, 0);
    let mut gap_since: Vec<Option<f64>> = vec![None; NUM_BLOCKS];
    let mut longest_gap: f64 = 0.0;
    let mut t = 0.0;
    while t < DURATION {
        let alive = nodes.iter().filter(|n| n.alive).count();
        // Churn: 7 nodes join in the first minute, then joins and leaves about every 60 s each, between 3 and 9
        // nodes: joins alone are too rare to fill gaps in time.
        let join = t < 60.0 && alive < 7 && rng.random_bool(TICK / 8.0)
            || t >= 60.0 && alive < 9 && rng.random_bool(TICK / 60.0);
        let leave = t >= 60.0 && alive > 3 && rng.random_bool(TICK / 60.0);
        if join {
            let len = lens[rng.random_range(0..lens.len())];
            let seen = plan::block_throughputs(&view(&nodes, None, t), NUM_BLOCKS, None);
            let start = plan::choose_start(&seen, len);
            let mut balancer = Balancer::new(config, rng.random());
            let next_check = t + LOAD + balancer.next_check().as_secs_f64();
            nodes.push(SimNode {
                id: format!("node{}", nodes.len()),
                throughput: rng.random_range(20.0..200.0),
                range: None,
                announcements: vec![],
                balancer,
                next_check,
                pending: Some((BlockRange::new(start, start + len), t + LOAD)),
                moves: 0,
                alive: true,
            });
            joins += 1;
        } else if leave {
            let alive: Vec<usize> = (0..nodes.len()).filter(|&i| nodes[i].alive).collect();
            let gone = alive[rng.random_range(0..alive.len())];
            let n = &mut nodes[gone];
            n.alive = false;
            n.range = None;
            n.pending = None;
            n.announcements.push((t, None));
            leaves += 1;
        }

        for i in 0..nodes.len() {
            if !nodes[i].alive {
                continue;
            }
            // A span finished loading: the first one is served at once, a move only if still worth it.
            if let Some((target, ready)) = nodes[i].pending {
                if t >= ready {
                    nodes[i].pending = None;
                    let commit = match nodes[i].range {
                        None => true,
                        Some(current) => {
                            let others = plan::block_throughputs(
                                &view(&nodes, Some(i), t),
                                NUM_BLOCKS,
                                None,
                            );
                            nodes[i].balancer.still_worth(
                                &others,
                                current,
                                target,
                                nodes[i].throughput,
                            )
                        }
                    };
                    if commit {
                        let n = &mut nodes[i];
                        if n.range.is_some() {
                            n.moves += 1;
                            n.balancer.moved(secs(t));
                        }
                        n.range = Some(target);
                        n.announcements.push((t, Some(target)));
                    }
                }
            }
            if t >= nodes[i].next_check && nodes[i].pending.is_none() {
                if let Some(current) = nodes[i].range {
                    let others =
                        plan::block_throughputs(&view(&nodes, Some(i), t), NUM_BLOCKS, None);
                    let own = nodes[i].throughput;
                    if let Some((target, _)) =
                        nodes[i].balancer.decide(secs(t), &others, current, own)
                    {
                        nodes[i].pending = Some((target, t + LOAD));
                    }
                }
                let n = &mut nodes[i];
                n.next_check = t + n.balancer.next_check().as_secs_f64();
            }
        }

        // Coverage by what is actually served.
        let serving = nodes.iter().filter(|n| n.range.is_some()).count();
        let mut served = [false; NUM_BLOCKS];
        for n in nodes.iter().filter(|n| n.alive) {
            if let Some(r) = n.range {
                served[r.start..r.end].iter_mut().for_each(|s| *s = true);
            }
        }
        for b in 0..NUM_BLOCKS {
            if served[b] || serving < enough {
                // Not a gap, or not one the balancer can be blamed for: too few nodes to cover everything.
                gap_since[b] = None;
            } else {
                let since = *gap_since[b].get_or_insert(t);
                longest_gap = longest_gap.max(t - since);
            }
        }
        t += TICK;
    }
    Outcome {
        longest_gap,
        most_moves: nodes.iter().map(|n| n.moves).max().unwrap_or(0),
        joins,
        leaves,
    }
}

fn check(lens: &[usize]) {
    let mut report = vec![];
    for seed in 0..24 {
        let o = simulate(seed, lens);
        report.push(format!(
            "seed {seed}: {} joins, {} leaves, longest gap {:.1} s, most moves {}",
            o.joins, o.leaves, o.longest_gap, o.most_moves
        ));
        let bound = PERIOD + PROPAGATION + LOAD + TICK;
        assert!(
            o.longest_gap <= bound,
            "a block stayed uncovered {:.1} s (> {bound} s)\n{}",
            o.longest_gap,
            report.join("\n")
        );
        assert!(
            o.most_moves <= MAX_MOVES,
            "a node moved {} times\n{}",
            o.most_moves,
            report.join("\n")
        );
        assert!(
            o.leaves >= 3,
            "the churn must really happen: {}",
            report.join("\n")
        );
    }
    println!("{}", report.join("\n"));
}

#[test]
fn a_churning_swarm_of_equal_spans_stays_covered_without_flapping() {
    check(&[10]);
}

#[test]
fn a_churning_swarm_of_mixed_spans_stays_covered_without_flapping() {
    check(&[7, 10, 15]);
}

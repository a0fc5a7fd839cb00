//! Where a span should go, from the swarm's announced throughput per block. Pure functions over numbers, so the
//! node, its balancer and the swarm simulation in the tests make exactly the same decisions.
//!
//! A server running its span at T tokens per second adds T to the capacity of every block it holds (each token
//! passes through all of them), so a block's throughput is the sum of its servers' announced throughputs, and the
//! swarm is as fast as its slowest block.
use petal_model::BlockRange;
use petal_proto::pb::ServerRecord;

/// Throughput of each of `num_blocks` blocks: the sum of the announced throughputs of the servers in `records`
/// holding it, leaving out the server `exclude` (a node looking at the swarm without itself). Records naming
/// blocks past the end count for the blocks that exist.
pub fn block_throughputs(
    records: &[ServerRecord],
    num_blocks: usize,
    exclude: Option<&str>,
) -> Vec<f64> {
    let mut throughputs = vec![0.0; num_blocks];
    for r in records {
        if exclude == Some(r.peer_id.as_str()) {
            continue;
        }
        let speed = f64::from(r.throughput_tokens_per_sec);
        // A server announcing no speed still covers its blocks: count it as barely there, not absent.
        let speed = if speed.is_finite() && speed > 0.0 {
            speed
        } else {
            f64::MIN_POSITIVE
        };
        let end = (r.end_block as usize).min(num_blocks);
        for t in throughputs
            .iter_mut()
            .take(end)
            .skip(r.start_block as usize)
        {
            *t += speed;
        }
    }
    throughputs
}

/// The start of the `len` consecutive blocks that most need a server: the window whose throughputs, sorted, are
/// smallest lexicographically (the fewest servers on its slowest block, then on its next slowest, ...), the
/// leftmost among equals. Whole gaps are filled before partial ones, and windows line up with the gaps, which keeps
/// spans from fragmenting.
pub fn choose_start(throughputs: &[f64], len: usize) -> usize {
    let len = len.clamp(1, throughputs.len().max(1));
    let mut best: Option<(Vec<f64>, usize)> = None;
    for start in 0..=throughputs.len().saturating_sub(len) {
        let mut window = throughputs[start..start + len].to_vec();
        window.sort_by(f64::total_cmp);
        let better = match &best {
            None => true,
            Some((b, _)) => window
                .iter()
                .zip(b)
                .map(|(x, y)| x.total_cmp(y))
                .find(|o| o.is_ne())
                .is_some_and(|o| o.is_lt()),
        };
        if better {
            best = Some((window, start));
        }
    }
    best.map_or(0, |(_, start)| start)
}

/// Blocks nobody serves.
pub fn uncovered(throughputs: &[f64]) -> usize {
    throughputs.iter().filter(|t| **t <= 0.0).count()
}

/// The slowest block's throughput (0 when some block has no server).
pub fn slowest(throughputs: &[f64]) -> f64 {
    throughputs
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(0.0)
}

/// Why a move is worth making.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Gain {
    /// Blocks nobody serves would be served.
    Coverage {
        uncovered_before: usize,
        uncovered_after: usize,
    },
    /// The slowest block gets faster by this factor (more than the quality asked for).
    Throughput { factor: f64 },
}

/// Where a server holding `current` at `own` tokens per second should move, given the other servers' per-block
/// throughput `others`, or `None` to stay. It moves only when
/// - every block it would leave keeps another server (a move never uncovers anything), and
/// - the move serves blocks nobody serves, or raises the slowest block's throughput by more than `quality` (> 1:
///   hysteresis, so servers do not trade places over noise).
pub fn should_move(
    others: &[f64],
    current: BlockRange,
    own: f64,
    quality: f64,
) -> Option<(BlockRange, Gain)> {
    let start = choose_start(others, current.len());
    let target = BlockRange::new(start, start + current.len());
    if target == current {
        return None;
    }
    let gain = move_gain(others, current, target, own, quality)?;
    Some((target, gain))
}

/// The gain of moving from `current` to `target` under the rules of [`should_move`], or `None` if it is not worth
/// it (or no longer is: a node re-checks before committing a move it has prepared, since others may have moved
/// meanwhile).
pub fn move_gain(
    others: &[f64],
    current: BlockRange,
    target: BlockRange,
    own: f64,
    quality: f64,
) -> Option<Gain> {
    let leaves_a_gap = (current.start..current.end)
        .filter(|b| !target.contains(*b))
        .any(|b| others.get(b).is_none_or(|t| *t <= 0.0));
    if leaves_a_gap || target.end > others.len() {
        return None;
    }
    let with = |range: BlockRange| -> Vec<f64> {
        let mut t = others.to_vec();
        for (b, x) in t.iter_mut().enumerate() {
            if range.contains(b) {
                *x += own;
            }
        }
        t
    };
    let (before, after) = (with(current), with(target));
    let (uncovered_before, uncovered_after) = (uncovered(&before), uncovered(&after));
    if uncovered_after < uncovered_before {
        return Some(Gain::Coverage {
            uncovered_before,
            uncovered_after,
        });
    }
    let (slow_before, slow_after) = (slowest(&before), slowest(&after));
    if uncovered_before == 0 && slow_after > slow_before * quality {
        return Some(Gain::Throughput {
            factor: slow_after / slow_before,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(peer: &str, start: u32, end: u32, tp: f32) -> ServerRecord {
        ServerRecord {
            peer_id: peer.into(),
            start_block: start,
            end_block: end,
            throughput_tokens_per_sec: tp,
            ..Default::default()
        }
    }

    #[test]
    fn throughput_per_block_sums_servers_and_can_leave_one_out() {
        let records = [
            record("a", 0, 4, 10.0),
            record("b", 2, 6, 5.0),
            record("c", 4, 99, 1.0),
        ];
        assert_eq!(
            block_throughputs(&records, 8, None),
            [10.0, 10.0, 15.0, 15.0, 6.0, 6.0, 1.0, 1.0]
        );
        assert_eq!(
            block_throughputs(&records, 8, Some("b")),
            [10.0, 10.0, 10.0, 10.0, 1.0, 1.0, 1.0, 1.0]
        );
    }

    #[test]
    fn joins_fill_gaps_in_order_then_the_slowest_span() {
        let mut t = vec![0.0; 30];
        let mut starts = vec![];
        for tp in [100.0, 50.0, 100.0] {
            let s = choose_start(&t, 10);
            starts.push(s);
            t[s..s + 10].iter_mut().for_each(|x| *x += tp);
        }
        assert_eq!(starts, [0, 10, 20]);
        // The fourth goes where throughput is lowest, aligned with it.
        assert_eq!(choose_start(&t, 10), 10);
        // A partial gap: the window covering all of it wins over one covering part of it.
        let t = [5.0, 5.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0];
        assert_eq!(choose_start(&t, 3), 2);
        assert_eq!(choose_start(&t, 8), 0);
        assert_eq!(choose_start(&t, 20), 0);
    }

    #[test]
    fn a_redundant_server_moves_into_a_gap_but_never_opens_one() {
        let span = |s| BlockRange::new(s, s + 10);
        // d duplicates 10..20; 0..10 lost its server.
        let others_of_d = block_throughputs(
            &[record("b", 10, 20, 10.0), record("c", 20, 30, 10.0)],
            30,
            None,
        );
        let (to, gain) = should_move(&others_of_d, span(10), 10.0, 1.2).expect("moves");
        assert_eq!(to, span(0));
        assert!(matches!(
            gain,
            Gain::Coverage {
                uncovered_before: 10,
                uncovered_after: 0
            }
        ));
        // c is the only server of 20..30: moving would open a gap there.
        let others_of_c = block_throughputs(
            &[record("b", 10, 20, 10.0), record("d", 10, 20, 10.0)],
            30,
            None,
        );
        assert_eq!(should_move(&others_of_c, span(20), 10.0, 1.2), None);
    }

    #[test]
    fn throughput_moves_need_more_than_the_quality_factor() {
        let span = |s| BlockRange::new(s, s + 10);
        // Blocks 10..20 run at 50, the rest at 100 plus a duplicate of 0..10 at `own`.
        let others = block_throughputs(
            &[
                record("a", 0, 10, 100.0),
                record("b", 10, 20, 50.0),
                record("c", 20, 30, 100.0),
            ],
            30,
            None,
        );
        let (to, gain) = should_move(&others, span(0), 60.0, 1.5).expect("50 -> 100 is 2x");
        assert_eq!(to, span(10));
        assert!(matches!(gain, Gain::Throughput { factor } if (factor - 2.0).abs() < 1e-9));
        assert_eq!(should_move(&others, span(0), 60.0, 2.5), None);
        // Already where it helps most.
        assert_eq!(should_move(&others, span(10), 60.0, 1.0), None);
    }
}

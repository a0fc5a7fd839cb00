//! Choosing a chain of servers that covers blocks 0..L: fewest hops first, then lowest total round-trip time.
use crate::error::{ClientError, Result};
use petal_model::BlockRange;
use petal_proto::pb::ServerRecord;
use std::collections::{BinaryHeap, HashSet};
use std::time::Duration;

/// One link of the chain: a server and the blocks it runs for us (a part of its span when spans overlap).
#[derive(Debug, Clone)]
pub struct Hop {
    pub record: ServerRecord,
    pub range: BlockRange,
}

impl Hop {
    pub fn peer_id(&self) -> &str {
        &self.record.peer_id
    }

    /// `name (peer…) blocks a..b`, for showing the route.
    pub fn describe(&self) -> String {
        let id = &self.record.peer_id;
        let short = &id[id.len().saturating_sub(8)..];
        match self.record.public_name.as_str() {
            "" => format!("{short}[{}]", self.range),
            name => format!("{name}({short})[{}]", self.range),
        }
    }
}

/// The best way found to reach a block position: (hops, total RTT, (previous position, server index)).
type Reach = Option<(usize, Duration, Option<(usize, usize)>)>;

/// RTT assumed for a server never pinged: worse than any loopback or LAN peer, so measured peers win ties.
pub const UNKNOWN_RTT: Duration = Duration::from_millis(250);

/// Plans a chain covering `target` (the whole model, or the blocks of a failed hop) from live `servers`, skipping
/// `banned` peers. From each position the chain may use any server whose span contains it and runs to that
/// server's end (or the target's); among chains with the fewest hops, the lowest sum of RTTs wins. Errors name the
/// blocks nobody serves.
pub fn plan_range(
    model_id: &str,
    servers: &[ServerRecord],
    target: BlockRange,
    rtt: impl Fn(&str) -> Option<Duration>,
    banned: &HashSet<String>,
) -> Result<Vec<Hop>> {
    let (first, num_blocks) = (target.start, target.end);
    let usable: Vec<&ServerRecord> = servers
        .iter()
        .filter(|s| !banned.contains(&s.peer_id) && s.start_block < s.end_block)
        .collect();
    // Dijkstra over block positions with cost (hops, rtt); positions only move forward.
    let mut best: Vec<Reach> = vec![None; num_blocks + 1];
    best[first] = Some((0, Duration::ZERO, None));
    let mut queue = BinaryHeap::new();
    queue.push(std::cmp::Reverse((0usize, Duration::ZERO, first)));
    while let Some(std::cmp::Reverse((hops, cost, pos))) = queue.pop() {
        if pos == num_blocks {
            break;
        }
        if best[pos].is_some_and(|(h, c, _)| (h, c) < (hops, cost)) {
            continue;
        }
        for (i, s) in usable.iter().enumerate() {
            let (start, end) = (
                s.start_block as usize,
                (s.end_block as usize).min(num_blocks),
            );
            if !(start <= pos && pos < end) {
                continue;
            }
            let next = (hops + 1, cost + rtt(&s.peer_id).unwrap_or(UNKNOWN_RTT));
            if best[end].is_none_or(|(h, c, _)| next < (h, c)) {
                best[end] = Some((next.0, next.1, Some((pos, i))));
                queue.push(std::cmp::Reverse((next.0, next.1, end)));
            }
        }
    }
    if best[num_blocks].is_none() {
        return Err(ClientError::Uncovered {
            model_id: model_id.to_string(),
            missing: uncovered(&usable, target),
        });
    }
    let mut hops = vec![];
    let mut pos = num_blocks;
    while let Some((_, _, Some((from, i)))) = best[pos] {
        hops.push(Hop {
            record: usable[i].clone(),
            range: BlockRange::new(from, pos),
        });
        pos = from;
    }
    hops.reverse();
    Ok(hops)
}

/// Maximal runs of blocks in `target` that no usable server holds.
fn uncovered(servers: &[&ServerRecord], target: BlockRange) -> Vec<BlockRange> {
    let held: HashSet<usize> = servers
        .iter()
        .flat_map(|s| s.start_block as usize..s.end_block as usize)
        .collect();
    let mut out: Vec<BlockRange> = vec![];
    for b in (target.start..target.end).filter(|b| !held.contains(b)) {
        match out.last_mut() {
            Some(r) if r.end == b => r.end = b + 1,
            _ => out.push(BlockRange::new(b, b + 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(peer: &str, start: u32, end: u32) -> ServerRecord {
        ServerRecord {
            peer_id: peer.into(),
            start_block: start,
            end_block: end,
            ..Default::default()
        }
    }

    fn plan(servers: &[ServerRecord], n: usize) -> Result<Vec<(String, BlockRange)>> {
        plan_with(servers, n, &[], &HashSet::new())
    }

    fn plan_with(
        servers: &[ServerRecord],
        n: usize,
        rtts: &[(&str, u64)],
        banned: &HashSet<String>,
    ) -> Result<Vec<(String, BlockRange)>> {
        let rtt = |p: &str| {
            rtts.iter()
                .find(|(q, _)| *q == p)
                .map(|(_, ms)| Duration::from_millis(*ms))
        };
        Ok(
            plan_range("m", servers, BlockRange::new(0, n), rtt, banned)?
                .into_iter()
                .map(|h| (h.record.peer_id.clone(), h.range))
                .collect(),
        )
    }

    #[test]
    fn chains_disjoint_spans() {
        let s = [server("c", 4, 5), server("a", 0, 2), server("b", 2, 4)];
        let route = plan(&s, 5).unwrap();
        let peers: Vec<_> = route.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(peers, ["a", "b", "c"]);
    }

    #[test]
    fn overlapping_spans_use_a_sub_range() {
        let route = plan(&[server("a", 0, 3), server("b", 2, 5)], 5).unwrap();
        assert_eq!(
            route,
            vec![
                ("a".into(), BlockRange::new(0, 3)),
                ("b".into(), BlockRange::new(3, 5))
            ]
        );
    }

    #[test]
    fn fewest_hops_then_lowest_rtt() {
        let s = [
            server("a", 0, 2),
            server("b", 2, 5),
            server("whole", 0, 5),
            server("whole2", 0, 5),
        ];
        let route = plan_with(&s, 5, &[("whole", 40), ("whole2", 3)], &HashSet::new()).unwrap();
        assert_eq!(route, vec![("whole2".into(), BlockRange::new(0, 5))]);
        let banned: HashSet<String> = ["whole".to_string(), "whole2".to_string()].into();
        let route = plan_with(&s, 5, &[], &banned).unwrap();
        assert_eq!(route.len(), 2);
    }

    #[test]
    fn plans_a_sub_range_for_failover() {
        let s = [server("a", 0, 3), server("b", 2, 5), server("c", 2, 4)];
        let banned: HashSet<String> = ["b".to_string()].into();
        let route = plan_range("m", &s, BlockRange::new(3, 5), |_| None, &banned).unwrap_err();
        assert!(route.to_string().contains("4..5"), "{route}");
        let route = plan_range("m", &s, BlockRange::new(3, 5), |_| None, &HashSet::new()).unwrap();
        assert_eq!(route.len(), 1);
        assert_eq!(route[0].range, BlockRange::new(3, 5));
    }

    #[test]
    fn names_uncovered_blocks() {
        let err = plan(&[server("a", 0, 2), server("b", 4, 5)], 8).unwrap_err();
        match err {
            ClientError::Uncovered { missing, .. } => {
                assert_eq!(missing, vec![BlockRange::new(2, 4), BlockRange::new(5, 8)])
            }
            other => panic!("{other}"),
        }
        assert!(plan(&[], 3).unwrap_err().to_string().contains("0..3"));
    }
}

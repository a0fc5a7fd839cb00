//! Choosing a chain of servers that covers blocks 0..L: the one with the lowest estimated time per token (round
//! trips, announced throughput and load).
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

/// The best way found to reach a block position: (estimated time per token, hops, (previous position, server
/// index)).
type Reach = Option<(Duration, usize, Option<(usize, usize)>)>;

/// RTT assumed for a server never pinged: worse than any loopback or LAN peer, so measured peers win ties.
pub const UNKNOWN_RTT: Duration = Duration::from_millis(250);
/// What each hop costs beyond its RTT and compute: the client's framing and (de)serialisation of the hidden
/// states, the server's scheduling. Keeps a chain from splitting into more hops than it gains from.
pub const HOP_OVERHEAD: Duration = Duration::from_millis(2);
/// Compute time per block assumed for a server that announces no throughput.
const UNKNOWN_BLOCK_TIME: Duration = Duration::from_millis(10);

/// Share of a lone step's time that each other session open on a server adds to a step there. Nodes batch the
/// steps that are ready together (continuous batching), and a decode step's matmuls are bound by reading the
/// weights, so a batch of n costs far less than n steps; but not every open session is stepping at once.
pub const LOAD_PER_SESSION: f64 = 0.25;

/// Estimated time one decode step of `blocks` of `server`'s blocks takes there. The announced throughput is
/// tokens per second through its whole span, so a block costs `1 / (throughput x span)`; the step shares the node
/// with the sessions open there, each adding [`LOAD_PER_SESSION`] of it.
pub fn compute_time(server: &ServerRecord, blocks: usize) -> Duration {
    let span = server.end_block.saturating_sub(server.start_block).max(1) as f64;
    let throughput = f64::from(server.throughput_tokens_per_sec);
    let per_block = if throughput.is_finite() && throughput > 0.0 {
        1.0 / (throughput * span)
    } else {
        UNKNOWN_BLOCK_TIME.as_secs_f64()
    };
    let load = 1.0 + LOAD_PER_SESSION * f64::from(server.sessions_open);
    Duration::from_secs_f64((per_block * blocks as f64 * load).min(3600.0))
}

/// Whether `server` announces room for a session of `positions` positions (true when it announces no cache).
fn has_room(server: &ServerRecord, positions: usize) -> bool {
    server.cache_tokens_total == 0 || server.cache_tokens_free >= positions as u64
}

/// Plans a chain covering `target` (the whole model, or the blocks of a failed hop) from live `servers`, skipping
/// `banned` peers, for a session of `positions` positions. From each position the chain may use any server whose
/// span contains it and runs to that server's end (or the target's); the chain with the lowest estimated time per
/// token wins: the sum over hops of RTT (`rtt` includes any relay's detour), [`compute_time`] and
/// [`HOP_OVERHEAD`] (Dijkstra over block positions; ties go to fewer hops). Servers that announce less free cache
/// than `positions` are left out, unless no chain can be made without them (they may make room by evicting idle
/// sessions, or have freed some since they announced). Errors name the blocks nobody serves.
pub fn plan_range(
    model_id: &str,
    servers: &[ServerRecord],
    target: BlockRange,
    rtt: impl Fn(&str) -> Option<Duration>,
    banned: &HashSet<String>,
    positions: usize,
) -> Result<Vec<Hop>> {
    let usable: Vec<&ServerRecord> = servers
        .iter()
        .filter(|s| !banned.contains(&s.peer_id) && s.start_block < s.end_block)
        .collect();
    let roomy: Vec<&ServerRecord> = usable
        .iter()
        .copied()
        .filter(|s| has_room(s, positions))
        .collect();
    cheapest_chain(&roomy, target, &rtt)
        .or_else(|| cheapest_chain(&usable, target, &rtt))
        .ok_or_else(|| ClientError::Uncovered {
            model_id: model_id.to_string(),
            missing: uncovered(&usable, target),
        })
}

/// The cheapest chain over `target` from `servers` (see [`plan_range`]), if they cover it.
fn cheapest_chain(
    servers: &[&ServerRecord],
    target: BlockRange,
    rtt: &impl Fn(&str) -> Option<Duration>,
) -> Option<Vec<Hop>> {
    let (first, num_blocks) = (target.start, target.end);
    let mut best: Vec<Reach> = vec![None; num_blocks + 1];
    best[first] = Some((Duration::ZERO, 0, None));
    let mut queue = BinaryHeap::new();
    queue.push(std::cmp::Reverse((Duration::ZERO, 0usize, first)));
    while let Some(std::cmp::Reverse((cost, hops, pos))) = queue.pop() {
        if pos == num_blocks {
            break;
        }
        if best[pos].is_some_and(|(c, h, _)| (c, h) < (cost, hops)) {
            continue;
        }
        for (i, s) in servers.iter().enumerate() {
            let (start, end) = (
                s.start_block as usize,
                (s.end_block as usize).min(num_blocks),
            );
            if !(start <= pos && pos < end) {
                continue;
            }
            let hop =
                rtt(&s.peer_id).unwrap_or(UNKNOWN_RTT) + compute_time(s, end - pos) + HOP_OVERHEAD;
            let next = (cost + hop, hops + 1);
            if best[end].is_none_or(|(c, h, _)| next < (c, h)) {
                best[end] = Some((next.0, next.1, Some((pos, i))));
                queue.push(std::cmp::Reverse((next.0, next.1, end)));
            }
        }
    }
    best[num_blocks]?;
    let mut hops = vec![];
    let mut pos = num_blocks;
    while let Some((_, _, Some((from, i)))) = best[pos] {
        hops.push(Hop {
            record: servers[i].clone(),
            range: BlockRange::new(from, pos),
        });
        pos = from;
    }
    hops.reverse();
    Some(hops)
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
            plan_range("m", servers, BlockRange::new(0, n), rtt, banned, 0)?
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
    fn lowest_rtt_among_equal_servers() {
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
        let route = plan_range("m", &s, BlockRange::new(3, 5), |_| None, &banned, 0).unwrap_err();
        assert!(route.to_string().contains("4..5"), "{route}");
        let route =
            plan_range("m", &s, BlockRange::new(3, 5), |_| None, &HashSet::new(), 0).unwrap();
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

    fn fast(peer: &str, start: u32, end: u32, tokens_per_sec: f32) -> ServerRecord {
        ServerRecord {
            throughput_tokens_per_sec: tokens_per_sec,
            cache_tokens_total: 1000,
            cache_tokens_free: 1000,
            ..server(peer, start, end)
        }
    }

    fn peers(route: &[(String, BlockRange)]) -> Vec<&str> {
        route.iter().map(|(p, _)| p.as_str()).collect()
    }

    #[test]
    fn the_faster_of_two_equal_hop_chains_wins() {
        // Two 2-hop chains over 30 blocks, same RTTs: a+b announce 10x the throughput of c+d.
        let s = [
            fast("c", 0, 15, 20.0),
            fast("d", 15, 30, 20.0),
            fast("a", 0, 15, 200.0),
            fast("b", 15, 30, 200.0),
        ];
        let rtts = [("a", 5), ("b", 5), ("c", 5), ("d", 5)];
        let route = plan_with(&s, 30, &rtts, &HashSet::new()).unwrap();
        assert_eq!(peers(&route), ["a", "b"]);
        // With the throughputs swapped the other chain wins: nothing else decides.
        let s = [
            fast("c", 0, 15, 200.0),
            fast("d", 15, 30, 200.0),
            fast("a", 0, 15, 20.0),
            fast("b", 15, 30, 20.0),
        ];
        let route = plan_with(&s, 30, &rtts, &HashSet::new()).unwrap();
        assert_eq!(peers(&route), ["c", "d"]);
    }

    #[test]
    fn a_fast_chain_of_two_hops_beats_a_slow_single_server() {
        // 30 blocks at 5 tokens/s is 200 ms a token; two hops at 100 tokens/s are 2 x (10 + 2 + 1) ms.
        let s = [
            fast("slow", 0, 30, 5.0),
            fast("a", 0, 15, 100.0),
            fast("b", 15, 30, 100.0),
        ];
        let rtts = [("slow", 1), ("a", 1), ("b", 1)];
        let route = plan_with(&s, 30, &rtts, &HashSet::new()).unwrap();
        assert_eq!(peers(&route), ["a", "b"]);
        // Equal throughput per block: one hop saves a round trip and the per-hop overhead.
        let s = [
            fast("one", 0, 30, 50.0),
            fast("a", 0, 15, 100.0),
            fast("b", 15, 30, 100.0),
        ];
        let rtts = [("one", 1), ("a", 1), ("b", 1)];
        let route = plan_with(&s, 30, &rtts, &HashSet::new()).unwrap();
        assert_eq!(peers(&route), ["one"]);
    }

    #[test]
    fn load_sends_sessions_to_the_other_replica() {
        let busy = ServerRecord {
            sessions_open: 4,
            ..fast("busy", 0, 10, 100.0)
        };
        let route =
            plan_with(&[busy, fast("idle", 0, 10, 60.0)], 10, &[], &HashSet::new()).unwrap();
        assert_eq!(peers(&route), ["idle"]);
    }

    #[test]
    fn servers_without_room_are_skipped_unless_nothing_else_covers() {
        let full = ServerRecord {
            cache_tokens_free: 100,
            ..fast("full", 0, 10, 1000.0)
        };
        let roomy = fast("roomy", 0, 10, 10.0);
        let plan = |servers: &[ServerRecord], positions| {
            plan_range(
                "m",
                servers,
                BlockRange::new(0, 10),
                |_| None,
                &HashSet::new(),
                positions,
            )
            .map(|r| r[0].record.peer_id.clone())
        };
        let both = [full.clone(), roomy];
        assert_eq!(plan(&both, 50).unwrap(), "full");
        assert_eq!(plan(&both, 500).unwrap(), "roomy");
        // Alone, the full server is still tried: it may make room (idle sessions evicted) or have freed some.
        assert_eq!(plan(&[full], 500).unwrap(), "full");
    }

    #[test]
    fn compute_time_follows_the_announced_throughput() {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // 100 tokens/s through 10 blocks: 1 ms a block; 4 other sessions open there add a lone step's time.
        let s = fast("a", 0, 10, 100.0);
        assert!((ms(compute_time(&s, 5)) - 5.0).abs() < 1e-6);
        let loaded = ServerRecord {
            sessions_open: 4,
            ..s
        };
        assert!((ms(compute_time(&loaded, 5)) - 10.0).abs() < 1e-6);
        let unknown = compute_time(&server("x", 0, 4), 2);
        assert!((ms(unknown) - 2.0 * ms(UNKNOWN_BLOCK_TIME)).abs() < 1e-6);
    }
}

//! What the monitor shows, built from the live server records: per model, the servers holding each block (a
//! coverage bar, red where nobody does), the throughput summed per block, and every server's announcement.
use petal_proto::pb::ServerRecord;
use serde::Serialize;
use std::collections::BTreeMap;

/// `GET /api/v1/state`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SwarmState {
    /// When this view was taken (Unix ms); 0 before the first look.
    pub updated_unix_ms: u64,
    /// Why the last look failed, if it did (the view is then the previous one).
    pub error: Option<String>,
    pub models: Vec<ModelState>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelState {
    pub model_id: String,
    pub model_name: String,
    pub num_blocks: usize,
    /// Servers holding each block.
    pub replicas: Vec<u32>,
    /// Sum of the announced throughputs (tokens/s) of the servers holding each block.
    pub throughput: Vec<f64>,
    /// Runs of blocks nobody serves, as `[start, end)`.
    pub uncovered: Vec<[usize; 2]>,
    pub servers: Vec<ServerState>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServerState {
    pub peer_id: String,
    pub public_name: String,
    pub start_block: u32,
    pub end_block: u32,
    pub throughput_tokens_per_sec: f32,
    pub sessions_open: u32,
    pub cache_tokens_free: u64,
    pub cache_tokens_total: u64,
    /// AutoNAT's verdict: public, private (reached through a relay) or unknown.
    pub reachability: String,
    /// Whether it relays for peers behind NAT.
    pub relay: bool,
    pub version: String,
    pub dtype: String,
    pub quantization: String,
    pub devices: Vec<String>,
    pub updated_unix_ms: u64,
}

/// The models seen so far (id -> name, blocks), so a model whose last server left still shows, all red.
pub type KnownModels = BTreeMap<String, (String, usize)>;

/// The view of `records` at `now_ms`; remembers their models in `known`.
pub fn build(records: &[ServerRecord], known: &mut KnownModels, now_ms: u64) -> SwarmState {
    for r in records {
        known.insert(
            r.model_id.clone(),
            (r.model_name.clone(), r.num_blocks as usize),
        );
    }
    let models = known
        .iter()
        .map(|(id, (name, num_blocks))| {
            let mut servers: Vec<&ServerRecord> =
                records.iter().filter(|r| &r.model_id == id).collect();
            servers.sort_by(|a, b| {
                (a.start_block, a.end_block, &a.public_name, &a.peer_id).cmp(&(
                    b.start_block,
                    b.end_block,
                    &b.public_name,
                    &b.peer_id,
                ))
            });
            model_state(id, name, *num_blocks, &servers)
        })
        .collect();
    SwarmState {
        updated_unix_ms: now_ms,
        error: None,
        models,
    }
}

fn model_state(id: &str, name: &str, num_blocks: usize, servers: &[&ServerRecord]) -> ModelState {
    let mut replicas = vec![0u32; num_blocks];
    let mut throughput = vec![0.0f64; num_blocks];
    for s in servers {
        let end = (s.end_block as usize).min(num_blocks);
        for b in (s.start_block as usize)..end {
            replicas[b] += 1;
            throughput[b] += f64::from(s.throughput_tokens_per_sec);
        }
    }
    let mut uncovered: Vec<[usize; 2]> = vec![];
    for (b, r) in replicas.iter().enumerate() {
        if *r > 0 {
            continue;
        }
        match uncovered.last_mut() {
            Some(run) if run[1] == b => run[1] = b + 1,
            _ => uncovered.push([b, b + 1]),
        }
    }
    ModelState {
        model_id: id.to_string(),
        model_name: name.to_string(),
        num_blocks,
        replicas,
        throughput,
        uncovered,
        servers: servers.iter().map(|s| server_state(s)).collect(),
    }
}

fn server_state(s: &ServerRecord) -> ServerState {
    ServerState {
        peer_id: s.peer_id.clone(),
        public_name: s.public_name.clone(),
        start_block: s.start_block,
        end_block: s.end_block,
        throughput_tokens_per_sec: s.throughput_tokens_per_sec,
        sessions_open: s.sessions_open,
        cache_tokens_free: s.cache_tokens_free,
        cache_tokens_total: s.cache_tokens_total,
        reachability: s.reachability_status().to_string(),
        relay: s.relay,
        version: s.petal_version.clone(),
        dtype: s.wire_dtype_name().to_string(),
        quantization: s.quantization.clone(),
        devices: s.device_spans(),
        updated_unix_ms: s.updated_unix_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(model: &str, name: &str, start: u32, end: u32, tp: f32) -> ServerRecord {
        ServerRecord {
            model_id: model.into(),
            model_name: "m".into(),
            num_blocks: 10,
            peer_id: name.into(),
            public_name: name.into(),
            start_block: start,
            end_block: end,
            throughput_tokens_per_sec: tp,
            ..Default::default()
        }
    }

    #[test]
    fn coverage_replicas_throughput_and_gaps() {
        let mut known = KnownModels::new();
        let records = [
            record("a", "n2", 5, 10, 2.0),
            record("a", "n1", 0, 3, 1.0),
            record("a", "n3", 5, 99, 4.0),
        ];
        let state = build(&records, &mut known, 7);
        assert_eq!(state.updated_unix_ms, 7);
        let m = &state.models[0];
        assert_eq!(m.replicas, [1, 1, 1, 0, 0, 2, 2, 2, 2, 2]);
        assert_eq!(m.throughput[5], 6.0);
        assert_eq!(m.uncovered, [[3, 5]]);
        let names: Vec<&str> = m.servers.iter().map(|s| s.public_name.as_str()).collect();
        assert_eq!(names, ["n1", "n2", "n3"]);
    }

    #[test]
    fn a_model_whose_servers_all_left_shows_uncovered() {
        let mut known = KnownModels::new();
        build(&[record("a", "n1", 0, 10, 1.0)], &mut known, 1);
        let state = build(&[], &mut known, 2);
        assert_eq!(state.models.len(), 1);
        assert_eq!(state.models[0].replicas, [0; 10]);
        assert_eq!(state.models[0].uncovered, [[0, 10]]);
        assert!(state.models[0].servers.is_empty());
    }
}

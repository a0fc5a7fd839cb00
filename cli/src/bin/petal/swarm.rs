//! `petal swarm`: which peer serves which blocks of which model.
use clap::Args;
use libp2p::Multiaddr;
use petal_client::SwarmClient;
use petal_proto::pb;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct SwarmArgs {
    /// Bootstrap peer(s), with /p2p/<peer id>.
    #[arg(long, required = true)]
    pub bootstrap: Vec<Multiaddr>,
    /// Only this model id.
    #[arg(long)]
    pub model_id: Option<String>,
    /// The private swarm's key file (`petal-node swarm-key --new`).
    #[arg(long, value_name = "FILE")]
    pub swarm_key: Option<std::path::PathBuf>,
    /// Print JSON (one array of server records) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Seconds to spend looking.
    #[arg(long, default_value = "5", value_parser = petal_cli::seconds::positive_seconds)]
    pub timeout: Duration,
}

pub async fn run(args: SwarmArgs) -> anyhow::Result<()> {
    let swarm_key = petal_cli::load_swarm_key(args.swarm_key.as_deref())?;
    let client = SwarmClient::join(args.bootstrap, swarm_key).await?;
    let mut servers = client
        .find_servers(args.model_id.as_deref(), args.timeout)
        .await?;
    client.shutdown().await;
    servers.sort_by(|a, b| {
        (&a.model_id, a.start_block, &a.peer_id).cmp(&(&b.model_id, b.start_block, &b.peer_id))
    });
    if args.json {
        let rows: Vec<_> = servers.iter().map(record_json).collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    if servers.is_empty() {
        println!("no live servers found");
        return Ok(());
    }
    println!(
        "{:<40} {:<54} {:<10} {:>7} {:<5} {:<22} {:>9} {:>11} {:<22} {:<13}",
        "MODEL",
        "PEER",
        "NAME",
        "BLOCKS",
        "DTYPE",
        "DEVICES",
        "TOKENS/S",
        "FREE CACHE",
        "MEMORY W+KV/BUDGET",
        "REACHABILITY"
    );
    for s in &servers {
        println!(
            "{:<40} {:<54} {:<10} {:>7} {:<5} {:<22} {:>9.1} {:>11} {:<22} {:<13}",
            s.model_id,
            s.peer_id,
            s.public_name,
            format!("{}..{}", s.start_block, s.end_block),
            s.wire_dtype_name(),
            s.device_spans().join(","),
            s.throughput_tokens_per_sec,
            s.cache_tokens_free,
            memory(s),
            reachability(s)
        );
    }
    Ok(())
}

/// Weights and KV budget of the span against the node's memory budget ("1.4G+512.0M/2.5G"); "-" from servers
/// that do not announce it.
fn memory(s: &pb::ServerRecord) -> String {
    if s.weight_bytes == 0 {
        return "-".into();
    }
    let short = |b: u64| bytesize::ByteSize(b).display().iec_short().to_string();
    let kv = short(s.cache_tokens_total.saturating_mul(s.kv_position_bytes));
    let budget = match s.memory_budget_bytes {
        0 => "?".to_string(),
        b => short(b),
    };
    format!("{}+{kv}/{budget}", short(s.weight_bytes))
}

/// AutoNAT's verdict, with "+relay" when the server relays for others.
fn reachability(s: &pb::ServerRecord) -> String {
    let status = s.reachability_status();
    if s.relay {
        format!("{status}+relay")
    } else {
        status.to_string()
    }
}

fn record_json(s: &pb::ServerRecord) -> serde_json::Value {
    serde_json::json!({
        "model_id": s.model_id,
        "model_name": s.model_name,
        "num_blocks": s.num_blocks,
        "peer_id": s.peer_id,
        "public_name": s.public_name,
        "addrs": s.addrs,
        "start_block": s.start_block,
        "end_block": s.end_block,
        "dtype": s.wire_dtype_name(),
        "quantization": s.quantization,
        "throughput_tokens_per_sec": s.throughput_tokens_per_sec,
        "cache_tokens_free": s.cache_tokens_free,
        "cache_tokens_total": s.cache_tokens_total,
        "sessions_open": s.sessions_open,
        "memory_budget_bytes": s.memory_budget_bytes,
        "weight_bytes": s.weight_bytes,
        "kv_position_bytes": s.kv_position_bytes,
        "kv_bytes_total": s.cache_tokens_total.saturating_mul(s.kv_position_bytes),
        "reachability": s.reachability_status(),
        "relay": s.relay,
        "devices": s.devices.iter().map(|d| serde_json::json!({
            "device": d.device, "start_block": d.start_block, "end_block": d.end_block,
            "free_memory_bytes": d.free_memory_bytes, "total_memory_bytes": d.total_memory_bytes,
        })).collect::<Vec<_>>(),
        "petal_version": s.petal_version,
        "updated_unix_ms": s.updated_unix_ms,
        "ttl_ms": s.ttl_ms,
    })
}

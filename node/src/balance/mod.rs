//! Automatic spans: a node started without `--blocks` picks the blocks the swarm needs most ([`choose_span`]),
//! and keeps re-checking at jittered intervals whether moving elsewhere would fill a gap or make the swarm's
//! slowest block markedly faster ([`run`]).
//!
//! [`plan`] holds the decisions (pure functions of the announced records), [`balancer`] the timing and
//! hysteresis around them; this module runs them against the DHT and moves the node through
//! [`crate::serving::Serving`].
pub mod balancer;
pub mod plan;

use crate::serving::Serving;
use balancer::{BalanceConfig, Balancer};
use petal_model::BlockRange;
use petal_p2p::{records::find_servers, NetError, Network};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

/// How long one look at the swarm may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// The per-block throughput of the servers of `model_id` other than this node, as the DHT tells it now.
pub async fn others_throughput(
    net: &Network,
    model_id: &str,
    num_blocks: usize,
) -> Result<Vec<f64>, NetError> {
    let records = find_servers(net, Some(model_id), LOOKUP_TIMEOUT).await?;
    let me = net.peer_id().to_string();
    Ok(plan::block_throughputs(&records, num_blocks, Some(&me)))
}

/// The `len` consecutive blocks of a `num_blocks`-block model a joining node should serve: where the swarm's
/// throughput is lowest (the first blocks when nobody else can be seen).
pub async fn choose_span(
    net: &Network,
    model_id: &str,
    num_blocks: usize,
    len: usize,
) -> Result<BlockRange, NetError> {
    let others = others_throughput(net, model_id, num_blocks).await?;
    let start = plan::choose_start(&others, len);
    let range = BlockRange::new(start, (start + len).min(num_blocks));
    tracing::info!(
        blocks = %range,
        servers_seen = others.iter().any(|t| *t > 0.0),
        "chose the blocks where the swarm's throughput is lowest"
    );
    Ok(range)
}

/// The balancer: checks at jittered intervals and moves the node when [`Balancer::decide`] says so and the move
/// is still worth it once the new span is loaded. Runs until aborted or the network stops.
pub async fn run(serving: Arc<Serving>, net: Network, config: BalanceConfig, drain: Duration) {
    let origin = tokio::time::Instant::now();
    let mut seed = std::collections::hash_map::DefaultHasher::new();
    net.peer_id().hash(&mut seed);
    let mut balancer = Balancer::new(config, seed.finish());
    let model_id = serving.current().model_id.clone();
    let num_blocks = serving.current().span.spec().num_blocks;
    loop {
        tokio::time::sleep(balancer.next_check()).await;
        let ctx = serving.current();
        let current = ctx.span.range();
        let own = f64::from(ctx.record().throughput_tokens_per_sec);
        drop(ctx);
        let others = match look(&net, &model_id, num_blocks).await {
            Look::Seen(t) => t,
            Look::Failed => continue,
            Look::Closed => return,
        };
        let Some((target, gain)) = balancer.decide(origin.elapsed(), &others, current, own) else {
            tracing::debug!(blocks = %current, "balanced: staying");
            continue;
        };
        tracing::info!(from = %current, to = %target, ?gain, "moving to where the swarm needs it more");
        let next = match serving.prepare(target).await {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, blocks = %target, "cannot load the new span; staying");
                continue;
            }
        };
        // Others may have moved while the span loaded (into the same gap, or out of the blocks left behind).
        let others = match look(&net, &model_id, num_blocks).await {
            Look::Seen(t) => t,
            Look::Failed => continue,
            Look::Closed => return,
        };
        if !balancer.still_worth(&others, current, target, own) {
            tracing::info!(blocks = %target, "the swarm changed while loading; the move is no longer worth it");
            continue;
        }
        serving.switch_to(next, drain).await;
        balancer.moved(origin.elapsed());
    }
}

/// One look at the swarm by the balancer.
enum Look {
    /// The other servers' per-block throughput.
    Seen(Vec<f64>),
    /// The lookup failed (logged): stay put this round.
    Failed,
    /// The network is gone: the balancer ends.
    Closed,
}

async fn look(net: &Network, model_id: &str, num_blocks: usize) -> Look {
    match others_throughput(net, model_id, num_blocks).await {
        Ok(t) => Look::Seen(t),
        Err(NetError::Closed) => Look::Closed,
        Err(e) => {
            tracing::warn!(error = %e, "cannot see the swarm; staying");
            Look::Failed
        }
    }
}

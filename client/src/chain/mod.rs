//! A session over a chain of servers: one [`HopClient`] per hop, hidden states streamed through them in order.
//! The chain keeps each hop's inputs, so when a server fails it bans it, plans a replacement chain for its blocks,
//! replays those inputs to rebuild the KV caches there, and carries on: the output is the same as an undisturbed
//! run's. With verification on, it also checks a sample of hops' steps on a second chain over the same blocks
//! ([`verify`]).
mod push;
mod verify;

use crate::error::{ClientError, Result};
use crate::hop::HopClient;
use crate::router::Hop;
use crate::swarm::SwarmClient;
use crate::verification::{Numerics, VerifyPolicy, VerifyTally};
use candle_core::Tensor;
use petal_model::compute::wire::from_wire;
use petal_model::BlockRange;
use petal_proto::pb;
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Bound on reaching a server again after its connection broke: long enough for a relayed connection and the
/// hole-punching attempt that follows it (up to 5 s), short enough that a dead server does not hold up its
/// replacement for long.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Timeouts and retry limits of a chain session.
#[derive(Debug, Clone)]
pub struct ChainConfig {
    /// Time a server gets to answer one request, plus `per_token_timeout` for each token of a step.
    pub step_timeout: Duration,
    /// Extra time a step gets per token it carries: a long prompt's prefill on a slow CPU takes longer than any
    /// fixed timeout meant for decode steps, and must not get a healthy server banned.
    pub per_token_timeout: Duration,
    /// Time to find servers covering a range (at open, and for a replacement).
    pub discovery_timeout: Duration,
    /// Time the open, or one step, may spend routing around failing servers (trying others, replaying) before
    /// it gives up with the last error. Zero: the first failure is final.
    pub failover_budget: Duration,
    /// Which hop steps are checked on a second server ([`crate::verification`]).
    pub verify: VerifyPolicy,
    /// Decode steps go server to server: the client sends each to the first hop, every hop pushes its output to
    /// the next, and each answers the client too (for replay). Off: the client drives every hop.
    pub push: bool,
}

impl Default for ChainConfig {
    fn default() -> Self {
        Self {
            step_timeout: Duration::from_secs(30),
            per_token_timeout: Duration::from_millis(50),
            discovery_timeout: Duration::from_secs(20),
            failover_budget: Duration::from_secs(90),
            verify: VerifyPolicy::default(),
            push: true,
        }
    }
}

impl ChainConfig {
    /// Time a server gets to answer a step of `tokens` tokens.
    pub fn timeout_for(&self, tokens: usize) -> Duration {
        self.step_timeout + self.per_token_timeout * u32::try_from(tokens).unwrap_or(u32::MAX)
    }
}

/// A server replaced mid-session.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Failover {
    pub failed_peer: String,
    pub range: BlockRange,
    pub reason: String,
    /// Steps replayed onto the replacement chain.
    pub replayed_steps: usize,
    /// Time from the failure to the replacement being ready (discovery, opening, replay).
    #[serde(serialize_with = "crate::serde_ms")]
    pub elapsed: Duration,
}

/// One link of an open chain: the hop's client and every input sent to it, in wire form, so a replacement server
/// can be rebuilt by replay, and the chain checking its answers.
struct ChainLink {
    hop: HopClient,
    history: Vec<(u32, pb::Tensor)>,
    /// A second chain over the same blocks on other servers, fed the same inputs; opened at the first check.
    shadow: Option<verify::Shadow>,
    /// Until when to stop looking for a second chain: none covered these blocks when last looked.
    unverifiable_until: Option<Instant>,
}

impl ChainLink {
    fn new(hop: HopClient) -> Self {
        Self {
            hop,
            history: vec![],
            shadow: None,
            unverifiable_until: None,
        }
    }

    /// Whether a check of this link can do nothing now: no second chain is open, and none covered its blocks when
    /// last looked, less than [`verify::RECHECK_AFTER`] ago.
    fn uncheckable(&self, now: Instant) -> bool {
        self.shadow.is_none() && self.unverifiable_until.is_some_and(|t| now < t)
    }

    /// What its answers' rounding depends on ([`Numerics`]).
    fn numerics(&self) -> Numerics {
        Numerics::of_server(&self.hop.hop().record, self.hop.wire_dtype())
    }
}

/// What one step through the chain cost at each hop.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct HopTiming {
    /// Client-side time from sending the step to decoding the answer.
    #[serde(serialize_with = "crate::serde_ms")]
    pub round_trip: Duration,
    /// The server's compute time for the step, as it reports it.
    #[serde(serialize_with = "crate::serde_ms")]
    pub compute: Duration,
    /// Whether the step's input reached this hop server to server (pushed by the previous hop, or sent with the
    /// route's rest when first).
    pub pushed: bool,
}

/// One hop of the route as it is now, for reports (`petal generate --json`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RouteHop {
    pub peer: String,
    pub name: String,
    pub blocks: String,
    /// "direct", or "relayed" when the stream goes through a circuit relay (hole punching did not succeed).
    pub path: &'static str,
}

/// Hidden states through a chain of servers, position by position.
pub struct ChainSession {
    client: SwarmClient,
    model_id: String,
    links: Vec<ChainLink>,
    position: usize,
    max_length: usize,
    config: ChainConfig,
    failovers: Vec<Failover>,
    verification: VerifyTally,
    /// Set when pushes between this route's servers did not arrive although every server was fine (no path
    /// between them, say): the session's later steps are client-driven.
    push_broken: bool,
}

impl ChainSession {
    /// Plans a chain covering blocks `0..num_blocks` and opens a session on every hop, each able to hold
    /// `max_length` positions. A server that refuses (busy, cache full) or fails is banned and routed around.
    pub async fn open(
        client: &SwarmClient,
        model_id: &str,
        num_blocks: usize,
        max_length: usize,
        config: ChainConfig,
    ) -> Result<Self> {
        let mut session = Self {
            client: client.clone(),
            model_id: model_id.to_string(),
            links: vec![],
            position: 0,
            max_length,
            config,
            failovers: vec![],
            verification: VerifyTally::default(),
            push_broken: false,
        };
        let whole = BlockRange::new(0, num_blocks);
        session.links = session.open_chain(whole, HashSet::new(), false).await?;
        tracing::info!(route = %session.route().join(" -> "), "session opened");
        Ok(session)
    }

    /// Opens sessions on a freshly planned chain over `range`, never on a peer in `exclude`, routing around
    /// servers that refuse. An `optional` chain (for checking answers) is planned from one look at the swarm and
    /// never on peers that failed recently ([`SwarmClient::plan_without`]).
    ///
    /// The future borrows nothing from the session: a `ChainSession` is `Send` but not `Sync` (libp2p streams are
    /// not), and a future holding `&self` across an await would make `step` unusable in spawned tasks.
    fn open_chain(
        &self,
        range: BlockRange,
        exclude: HashSet<String>,
        optional: bool,
    ) -> impl std::future::Future<Output = Result<Vec<ChainLink>>> + Send + 'static {
        let client = self.client.clone();
        let model_id = self.model_id.clone();
        let max_length = self.max_length;
        let config = self.config.clone();
        async move {
            let net = client.network();
            let deadline = Instant::now() + config.failover_budget;
            'plan: loop {
                let route = client
                    .plan_without(
                        &model_id,
                        range,
                        &exclude,
                        config.discovery_timeout,
                        optional,
                        max_length,
                    )
                    .await?;
                let banned = client.banned();
                let mut links = Vec::with_capacity(route.len());
                for hop in route {
                    let peer = hop.record.peer_id.clone();
                    match open_hop(net, &model_id, hop, max_length, config.step_timeout).await {
                        Ok(hop) => links.push(ChainLink::new(hop)),
                        Err(e) if e.is_retryable() && Instant::now() < deadline => {
                            tracing::warn!(%peer, error = %e, "server refused or failed to open a session; routing around it");
                            client.ban(&peer);
                            if banned.contains(&peer) && !pause_to_replan(deadline).await {
                                return Err(e);
                            }
                            continue 'plan;
                        }
                        Err(e) => return Err(e),
                    }
                }
                return Ok(links);
            }
        }
    }

    pub fn position(&self) -> usize {
        self.position
    }

    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// `name(peer)[a..b]` for each hop, in order.
    pub fn route(&self) -> Vec<String> {
        self.links.iter().map(|l| l.hop.hop().describe()).collect()
    }

    /// Each hop's server, blocks and path (direct or relayed), in order.
    pub fn hops(&self) -> Vec<RouteHop> {
        self.links
            .iter()
            .map(|l| {
                let hop = l.hop.hop();
                RouteHop {
                    peer: hop.record.peer_id.clone(),
                    name: hop.record.public_name.clone(),
                    blocks: hop.range.to_string(),
                    path: if l.hop.relayed() { "relayed" } else { "direct" },
                }
            })
            .collect()
    }

    /// Servers replaced so far.
    pub fn failovers(&self) -> &[Failover] {
        &self.failovers
    }

    /// What the checks of hops' answers found so far.
    pub fn verification(&self) -> &VerifyTally {
        &self.verification
    }

    /// Bytes sent and received on all hops' streams so far (second chains' included).
    pub fn bytes_on_wire(&self) -> u64 {
        let shadows = self.links.iter().flat_map(|l| &l.shadow);
        let links: u64 = self.links.iter().map(|l| l.hop.bytes_on_wire()).sum();
        links + shadows.map(|s| s.bytes_on_wire()).sum::<u64>()
    }

    /// Runs `hidden` (`[batch, tokens, hidden]`) for the next positions through every hop and returns the last
    /// hop's output with each hop's timing, replacing failed servers on the way. Single-token steps go server to
    /// server when every hop takes pushes and none is drawn for a check ([`ChainConfig::push`]).
    pub async fn step(&mut self, hidden: &Tensor) -> Result<(Tensor, Vec<HopTiming>)> {
        let tokens = hidden.dim(1).map_err(petal_model::ModelError::from)?;
        let deadline = Instant::now() + self.config.failover_budget;
        let timeout = self.config.timeout_for(tokens);
        // A draw on a link that cannot be checked is counted as unverifiable here and dropped, so that the step
        // can still go server to server: checking would only have made it client-driven, for nothing.
        let now = Instant::now();
        let mut draws = VecDeque::with_capacity(self.links.len());
        for i in 0..self.links.len() {
            let drawn = self.config.verify.draw();
            let uncheckable = self.links[i].uncheckable(now);
            if drawn && uncheckable {
                self.verification.unverifiable += 1;
            }
            draws.push_back(drawn && !uncheckable);
        }
        let end = self.links.len();
        let (x, timings) = match self.push_targets(tokens, &draws) {
            Some(targets) => self.step_pushed(hidden, targets, timeout, deadline).await?,
            None => {
                let mut timings = Vec::with_capacity(end);
                let (x, _) = self
                    .drive(
                        0,
                        end,
                        hidden.clone(),
                        &mut timings,
                        draws,
                        timeout,
                        deadline,
                    )
                    .await?;
                (x, timings)
            }
        };
        self.position += tokens;
        Ok((x, timings))
    }

    /// Runs `x` through links `hop..end` in order, the client sending each its input, replacing failed servers
    /// (which moves `end` by the links that replaced them); checks the steps drawn in `draws` (one per link,
    /// drawn afresh when it runs out). Returns the output and the new `end`.
    #[allow(clippy::too_many_arguments)]
    async fn drive(
        &mut self,
        mut hop: usize,
        mut end: usize,
        mut x: Tensor,
        timings: &mut Vec<HopTiming>,
        mut draws: VecDeque<bool>,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<(Tensor, usize)> {
        while hop < end {
            let link = &mut self.links[hop];
            match link.hop.step(&x, self.position, timeout).await {
                Ok(out) => {
                    link.history.push((self.position as u32, out.sent));
                    timings.push(HopTiming {
                        round_trip: out.round_trip,
                        compute: out.compute,
                        pushed: false,
                    });
                    // Fed to the hop's shadow, and checked when drawn. On a proven lie the hop is replaced by the
                    // chain that outvoted it (it may have several links) and the answer by that chain's.
                    let drawn = draws
                        .pop_front()
                        .unwrap_or_else(|| self.config.verify.draw());
                    let before = self.links.len();
                    let (checked, links) =
                        self.check(hop, out.hidden, self.position, drawn).await?;
                    end = end + self.links.len() - before;
                    x = checked;
                    hop += links;
                }
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    let before = self.links.len();
                    self.replace(hop, e, deadline).await?;
                    end = end + self.links.len() - before;
                }
                Err(e) => return Err(e),
            }
        }
        Ok((x, end))
    }

    /// Replaces hop `i` by a new chain over its blocks and replays its history there, trying other servers until
    /// `deadline`.
    async fn replace(&mut self, i: usize, cause: ClientError, deadline: Instant) -> Result<()> {
        let started = Instant::now();
        let failed = self.links.remove(i);
        let failed_hop = failed.hop.hop().clone();
        let range = failed_hop.range;
        let failover = |reason: String| Failover {
            failed_peer: failed_hop.peer_id().to_string(),
            range,
            reason,
            replayed_steps: failed.history.len(),
            elapsed: started.elapsed(),
        };
        // A broken stream or connection (a relay circuit at its limit, an expired NAT mapping, a network blip) says
        // nothing about the server: try it again, with replay, before banning it.
        if cause.is_connection_lost() {
            let net = self.client.network().clone();
            let (model_id, max_length) = (self.model_id.clone(), self.max_length);
            let config = self.config.clone();
            let reconnected = reconnect(
                &net,
                &model_id,
                max_length,
                &config,
                &failed_hop,
                &failed.history,
                started,
            )
            .await;
            match reconnected {
                Ok(link) => {
                    let done = failover(format!("reconnected after: {cause}"));
                    tracing::info!(peer = %failed_hop.peer_id(), %range, replayed = done.replayed_steps, elapsed_ms = done.elapsed.as_millis() as u64, "reconnected to the same server");
                    self.failovers.push(done);
                    self.links.insert(i, link);
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(peer = %failed_hop.peer_id(), error = %e, "reconnecting failed")
                }
            }
        }
        if cause.is_eviction() {
            tracing::info!(peer = %failed_hop.peer_id(), %range, "session evicted for another peer; opening a new one");
        } else {
            tracing::warn!(peer = %failed_hop.peer_id(), %range, error = %cause, "server failed; replacing it");
            self.client.ban(failed_hop.peer_id());
        }
        loop {
            let banned = self.client.banned();
            let mut fresh = self.open_chain(range, HashSet::new(), false).await?;
            match replay(&mut fresh, &failed.history, &self.config).await {
                Ok(()) => {
                    let done = failover(cause.to_string());
                    tracing::info!(%range, replayed = done.replayed_steps, elapsed_ms = done.elapsed.as_millis() as u64, "replacement ready");
                    self.failovers.push(done);
                    self.links.splice(i..i, fresh);
                    return Ok(());
                }
                Err((hop, e)) if e.is_retryable() && Instant::now() < deadline => {
                    let peer = fresh[hop].hop.hop().peer_id().to_string();
                    self.client.ban(&peer);
                    if banned.contains(&peer) && !pause_to_replan(deadline).await {
                        return Err(e);
                    }
                }
                Err((_, e)) => return Err(e),
            }
        }
    }

    /// Raises the positions the session may hold to `max_length` on every hop (a generation or conversation that
    /// goes on). A server that cannot grow its reservation is replaced, over a chain opened at the new length and
    /// replayed; checking chains are dropped and reopened at the new length when next drawn.
    pub async fn extend(&mut self, max_length: usize) -> Result<()> {
        if max_length <= self.max_length {
            return Ok(());
        }
        self.max_length = max_length;
        let deadline = Instant::now() + self.config.failover_budget;
        let mut i = 0;
        while i < self.links.len() {
            let link = &mut self.links[i];
            link.shadow = None;
            match link.hop.extend(max_length, self.config.step_timeout).await {
                Ok(()) => i += 1,
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    // Its replacement links are opened at the new length.
                    let before = self.links.len();
                    self.replace(i, e, deadline).await?;
                    i += 1 + self.links.len() - before;
                }
                Err(e) => return Err(e),
            }
        }
        tracing::debug!(max_length, "session extended");
        Ok(())
    }

    /// Closes every hop's session (best effort: servers also free sessions when the stream ends).
    pub async fn close(self) {
        for link in self.links {
            link.hop.close(self.config.step_timeout).await;
        }
    }
}

/// How long to wait before planning again when the only servers left for some blocks are banned ones that failed
/// again: the swarm may be healing (a dead server's record expiring, a node moving to those blocks).
const REPLAN_PAUSE: Duration = Duration::from_secs(1);

/// A server chosen although banned, for want of others, failed again: pauses before the caller plans again, or
/// says there is no time left before `deadline` (the caller then gives up with the error).
async fn pause_to_replan(deadline: Instant) -> bool {
    if Instant::now() + REPLAN_PAUSE >= deadline {
        return false;
    }
    tracing::info!("no other server for these blocks yet; looking again shortly");
    tokio::time::sleep(REPLAN_PAUSE).await;
    true
}

/// Opens a session on `hop`. A stream that breaks while opening is no reason to ban the server (a stale
/// connection, a blip): that is retried through [`reopen`].
async fn open_hop(
    net: &petal_p2p::Network,
    model_id: &str,
    hop: Hop,
    max_length: usize,
    timeout: Duration,
) -> Result<HopClient> {
    match HopClient::open(net, model_id, hop.clone(), max_length, timeout).await {
        Err(e) if e.is_connection_lost() => {
            tracing::debug!(peer = %hop.peer_id(), error = %e, "opening a session broke; trying again");
            reopen(net, model_id, hop, max_length, timeout, Instant::now()).await
        }
        other => other,
    }
}

/// Opens a session on `hop` after a stream to its server broke at `broke_at`: first on the connections there are
/// (the stream may have broken alone), then, if that breaks too, on a new connection. Only connections
/// established before `broke_at` are closed for that, so the sessions that other tasks are opening to the same
/// server on newer connections carry on.
async fn reopen(
    net: &petal_p2p::Network,
    model_id: &str,
    hop: Hop,
    max_length: usize,
    timeout: Duration,
    broke_at: Instant,
) -> Result<HopClient> {
    match HopClient::open(net, model_id, hop.clone(), max_length, timeout).await {
        Err(e) if e.is_connection_lost() => {
            tracing::debug!(peer = %hop.peer_id(), error = %e, "broke again; trying a fresh connection");
            if let Ok(peer) = hop.record.peer_id.parse() {
                net.close_connections_before(peer, broke_at, Duration::from_secs(2))
                    .await;
            }
            HopClient::open(net, model_id, hop, max_length, timeout).await
        }
        other => other,
    }
}

/// A fresh session with the same server for the same blocks, rebuilt by replaying `history`. A free function so
/// its future borrows nothing from the (non-`Sync`) session.
async fn reconnect(
    net: &petal_p2p::Network,
    model_id: &str,
    max_length: usize,
    config: &ChainConfig,
    hop: &Hop,
    history: &[(u32, pb::Tensor)],
    broke_at: Instant,
) -> Result<ChainLink> {
    let open_timeout = config.step_timeout.min(RECONNECT_TIMEOUT);
    let client = reopen(
        net,
        model_id,
        hop.clone(),
        max_length,
        open_timeout,
        broke_at,
    )
    .await?;
    let mut fresh = [ChainLink::new(client)];
    replay(&mut fresh, history, config)
        .await
        .map_err(|(_, e)| e)?;
    let [link] = fresh;
    Ok(link)
}

/// Sends a failed hop's recorded inputs, step by step as they were first sent (the same chunking gives the same
/// numerics), through a replacement chain, whose links record them in turn. On error, says which link failed.
async fn replay(
    chain: &mut [ChainLink],
    history: &[(u32, pb::Tensor)],
    config: &ChainConfig,
) -> std::result::Result<(), (usize, ClientError)> {
    for (position, input) in history {
        run_recorded(chain, *position, input, config).await?;
    }
    Ok(())
}

/// Runs one recorded step input (`input`, for positions `position..`) through `chain`, as [`run_links`] does.
async fn run_recorded(
    chain: &mut [ChainLink],
    position: u32,
    input: &pb::Tensor,
    config: &ChainConfig,
) -> std::result::Result<Tensor, (usize, ClientError)> {
    let x = recorded(input).map_err(|e| (0, e))?;
    let timeout = config.timeout_for(x.dim(1).unwrap_or(1));
    run_links(chain, x, position, timeout).await
}

/// Runs `x` for positions `position..` through `chain`'s links in order, each recording its input, and returns the
/// last one's output. On error, says which link failed.
async fn run_links(
    chain: &mut [ChainLink],
    mut x: Tensor,
    position: u32,
    timeout: Duration,
) -> std::result::Result<Tensor, (usize, ClientError)> {
    for (i, link) in chain.iter_mut().enumerate() {
        let out = link
            .hop
            .step(&x, position as usize, timeout)
            .await
            .map_err(|e| (i, e))?;
        link.history.push((position, out.sent));
        x = out.hidden;
    }
    Ok(x)
}

/// A recorded step input as a tensor again. It was encoded here, so a failure is a local bug, never a server's
/// fault (the error is not retryable).
fn recorded(input: &pb::Tensor) -> Result<Tensor> {
    let (dtype, shape) = petal_proto::tensor::validate(input, usize::MAX)
        .map_err(|e| ClientError::Request(format!("a recorded step input is malformed: {e}")))?;
    Ok(from_wire(input, dtype, &shape)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_timeouts_grow_with_the_tokens_of_a_step() {
        let config = ChainConfig::default();
        assert_eq!(config.timeout_for(1), Duration::from_millis(30_050));
        // A 3,000-token prompt gets 180 s, not the 30 s meant for decode steps.
        assert_eq!(config.timeout_for(3000), Duration::from_secs(180));
    }
}

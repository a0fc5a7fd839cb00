//! An inference session over a chain of servers: one libp2p stream and one server-side session per hop, hidden
//! states streamed through them in order. Each hop keeps the inputs it was sent, so when a server fails the
//! session bans it, plans a replacement chain for its blocks, replays those inputs to rebuild the KV caches there,
//! and carries on: the output is the same as an undisturbed run's.
use crate::error::{ClientError, Result};
use crate::router::Hop;
use crate::swarm::SwarmClient;
use candle_core::Tensor;
use petal_model::wire::{from_wire, to_wire};
use petal_model::BlockRange;
use petal_p2p::{Network, PeerId, Stream};
use petal_proto::pb::{self, request, response};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION};
use std::time::{Duration, Instant};

/// One hop's open session.
struct RemoteSpan {
    hop: Hop,
    stream: FramedStream<Stream>,
    session_id: u64,
    dtype: pb::WireDType,
    /// Every input sent to this hop, in wire form, so a replacement server can be rebuilt by replay.
    history: Vec<(u32, pb::Tensor)>,
}

impl RemoteSpan {
    async fn open(
        net: &Network,
        model_id: &str,
        hop: Hop,
        max_length: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let peer: PeerId = hop
            .record
            .peer_id
            .parse()
            .map_err(|_| ClientError::Protocol {
                peer: hop.record.peer_id.clone(),
                reason: "record carries an invalid peer id".into(),
            })?;
        let stream = tokio::time::timeout(timeout, net.open_stream(peer))
            .await
            .map_err(|_| ClientError::Timeout {
                peer: hop.record.peer_id.clone(),
                seconds: timeout.as_secs_f64(),
            })??;
        let mut span = Self {
            stream: FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES),
            session_id: 0,
            dtype: pb::WireDType::F32,
            history: vec![],
            hop,
        };
        let open = request::Kind::Open(pb::OpenSession {
            protocol_version: PROTOCOL_VERSION,
            model_id: model_id.to_string(),
            start_block: span.hop.range.start as u32,
            end_block: span.hop.range.end as u32,
            max_length: max_length as u32,
        });
        match span.call(open, timeout).await? {
            response::Kind::Opened(o) => {
                span.session_id = o.session_id;
                span.dtype = pb::WireDType::try_from(o.dtype)
                    .map_err(|_| span.protocol("unknown session dtype"))?;
                Ok(span)
            }
            _ => Err(span.protocol("expected SessionOpened")),
        }
    }

    fn protocol(&self, reason: &str) -> ClientError {
        ClientError::Protocol {
            peer: self.hop.record.peer_id.clone(),
            reason: reason.to_string(),
        }
    }

    /// Sends one request and waits for its response; a server error becomes [`ClientError::Server`].
    async fn call(&mut self, kind: request::Kind, timeout: Duration) -> Result<response::Kind> {
        let peer = self.hop.record.peer_id.clone();
        let exchange = async {
            self.stream.send(&pb::Request { kind: Some(kind) }).await?;
            self.stream.recv::<pb::Response>().await
        };
        let reply = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| ClientError::Timeout {
                peer: peer.clone(),
                seconds: timeout.as_secs_f64(),
            })?
            .map_err(|e| ClientError::Protocol {
                peer: peer.clone(),
                reason: e.to_string(),
            })?;
        match reply.and_then(|r| r.kind) {
            Some(response::Kind::Error(e)) => Err(ClientError::Server {
                peer,
                code: pb::ErrorCode::try_from(e.code).unwrap_or(pb::ErrorCode::Unspecified),
                message: e.message,
            }),
            Some(kind) => Ok(kind),
            None => Err(self.protocol("stream closed or empty response")),
        }
    }

    async fn step(
        &mut self,
        hidden: &Tensor,
        position: usize,
        timeout: Duration,
    ) -> Result<Tensor> {
        let wire = to_wire(hidden, self.dtype)?;
        let step = request::Kind::Step(pb::Step {
            session_id: self.session_id,
            position: position as u32,
            hidden: Some(wire.clone()),
        });
        let result = match self.call(step, timeout).await? {
            response::Kind::Step(s) => s,
            _ => return Err(self.protocol("expected StepResult")),
        };
        let out = result
            .hidden
            .ok_or_else(|| self.protocol("StepResult without hidden states"))?;
        let max = hidden.elem_count();
        let (dtype, shape) = petal_proto::tensor::validate(&out, max)
            .map_err(|e| self.protocol(&format!("bad hidden states: {e}")))?;
        if shape != hidden.dims() {
            return Err(self.protocol(&format!(
                "answered shape {shape:?} for input {:?}",
                hidden.dims()
            )));
        }
        petal_proto::tensor::check_finite(dtype, &out.data)
            .map_err(|e| self.protocol(&format!("bad hidden states: {e}")))?;
        self.history.push((position as u32, wire));
        Ok(from_wire(&out, dtype, &shape)?)
    }

    async fn close(mut self, timeout: Duration) {
        let close = request::Kind::Close(pb::CloseSession {
            session_id: self.session_id,
        });
        if let Err(e) = self.call(close, timeout).await {
            tracing::debug!(error = %e, "closing a session failed; the server frees it on disconnect");
        }
        self.stream.close().await;
    }
}

/// Timeouts and retry limits of a session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Time a server gets to answer one request.
    pub step_timeout: Duration,
    /// Time to find servers covering a range (at open, and for a replacement).
    pub discovery_timeout: Duration,
    /// Replacements one step may go through before giving up.
    pub max_failovers: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            step_timeout: Duration::from_secs(30),
            discovery_timeout: Duration::from_secs(20),
            max_failovers: 5,
        }
    }
}

/// A server replaced mid-session.
#[derive(Debug, Clone)]
pub struct Failover {
    pub failed_peer: String,
    pub range: BlockRange,
    pub reason: String,
    /// Steps replayed onto the replacement chain.
    pub replayed_steps: usize,
    /// Time from the failure to the replacement being ready (discovery, opening, replay).
    pub elapsed: Duration,
}

/// Hidden states through a chain of servers, position by position.
pub struct InferenceSession {
    client: SwarmClient,
    model_id: String,
    spans: Vec<RemoteSpan>,
    position: usize,
    max_length: usize,
    config: SessionConfig,
    failovers: Vec<Failover>,
}

impl InferenceSession {
    /// Plans a chain covering blocks `0..num_blocks` and opens a session on every hop, each able to hold
    /// `max_length` positions. A server that refuses (busy, cache full) or fails is banned and routed around.
    pub async fn open(
        client: &SwarmClient,
        model_id: &str,
        num_blocks: usize,
        max_length: usize,
        config: SessionConfig,
    ) -> Result<Self> {
        let mut session = Self {
            client: client.clone(),
            model_id: model_id.to_string(),
            spans: vec![],
            position: 0,
            max_length,
            config,
            failovers: vec![],
        };
        session.spans = session.open_chain(BlockRange::new(0, num_blocks)).await?;
        tracing::info!(route = %session.route().join(" -> "), "session opened");
        Ok(session)
    }

    /// Opens sessions on a freshly planned chain over `range`, routing around servers that refuse.
    ///
    /// The future borrows nothing from the session: an `InferenceSession` is `Send` but not `Sync` (libp2p streams
    /// are not), and a future holding `&self` across an await would make `step` unusable in spawned tasks.
    fn open_chain(
        &self,
        range: BlockRange,
    ) -> impl std::future::Future<Output = Result<Vec<RemoteSpan>>> + Send + 'static {
        let client = self.client.clone();
        let model_id = self.model_id.clone();
        let max_length = self.max_length;
        let config = self.config.clone();
        async move {
            let net: &Network = client.network();
            let mut attempts = 0;
            'plan: loop {
                let route = client
                    .plan(&model_id, range, config.discovery_timeout)
                    .await?;
                let mut spans = Vec::with_capacity(route.len());
                for hop in route {
                    let peer = hop.record.peer_id.clone();
                    match RemoteSpan::open(net, &model_id, hop, max_length, config.step_timeout)
                        .await
                    {
                        Ok(span) => spans.push(span),
                        Err(e) if e.is_retryable() && attempts < config.max_failovers => {
                            tracing::warn!(%peer, error = %e, "server refused or failed to open a session; routing around it");
                            client.ban(&peer);
                            attempts += 1;
                            continue 'plan;
                        }
                        Err(e) => return Err(e),
                    }
                }
                return Ok(spans);
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
        self.spans.iter().map(|s| s.hop.describe()).collect()
    }

    /// Servers replaced so far.
    pub fn failovers(&self) -> &[Failover] {
        &self.failovers
    }

    /// Bytes sent and received on all hops' streams so far.
    pub fn bytes_on_wire(&self) -> u64 {
        self.spans
            .iter()
            .map(|s| s.stream.bytes_sent() + s.stream.bytes_received())
            .sum()
    }

    /// Runs `hidden` (`[batch, tokens, hidden]`) for the next positions through every hop and returns the last
    /// hop's output, replacing failed servers on the way.
    pub async fn step(&mut self, hidden: &Tensor) -> Result<Tensor> {
        let tokens = hidden.dim(1).map_err(petal_model::ModelError::from)?;
        let mut x = hidden.clone();
        let mut hop = 0;
        let mut failovers = 0;
        while hop < self.spans.len() {
            match self.spans[hop]
                .step(&x, self.position, self.config.step_timeout)
                .await
            {
                Ok(out) => {
                    x = out;
                    hop += 1;
                }
                Err(e) if e.is_retryable() && failovers < self.config.max_failovers => {
                    failovers += 1;
                    self.replace(hop, e).await?;
                }
                Err(e) => return Err(e),
            }
        }
        self.position += tokens;
        Ok(x)
    }

    /// Replaces hop `i` by a new chain over its blocks and replays its history there.
    async fn replace(&mut self, i: usize, cause: ClientError) -> Result<()> {
        let started = Instant::now();
        let failed = self.spans.remove(i);
        let range = failed.hop.range;
        tracing::warn!(peer = %failed.hop.peer_id(), %range, error = %cause, "server failed; replacing it");
        self.client.ban(failed.hop.peer_id());
        let mut attempts = 0;
        loop {
            let mut fresh = self.open_chain(range).await?;
            match replay(&mut fresh, &failed.history, self.config.step_timeout).await {
                Ok(()) => {
                    self.failovers.push(Failover {
                        failed_peer: failed.hop.peer_id().to_string(),
                        range,
                        reason: cause.to_string(),
                        replayed_steps: failed.history.len(),
                        elapsed: started.elapsed(),
                    });
                    tracing::info!(%range, replayed = failed.history.len(), elapsed_ms = started.elapsed().as_millis() as u64, "replacement ready");
                    self.spans.splice(i..i, fresh);
                    return Ok(());
                }
                Err((hop, e)) if e.is_retryable() && attempts < self.config.max_failovers => {
                    self.client.ban(fresh[hop].hop.peer_id());
                    attempts += 1;
                }
                Err((_, e)) => return Err(e),
            }
        }
    }

    /// Closes every hop's session (best effort: servers also free sessions when the stream ends).
    pub async fn close(self) {
        for span in self.spans {
            span.close(self.config.step_timeout).await;
        }
    }
}

/// Sends a failed hop's recorded inputs, step by step as they were first sent (the same chunking gives the same
/// numerics), through a replacement chain. On error, says which hop of the chain failed.
async fn replay(
    chain: &mut [RemoteSpan],
    history: &[(u32, pb::Tensor)],
    timeout: Duration,
) -> std::result::Result<(), (usize, ClientError)> {
    for (position, input) in history {
        let local = |e: String| {
            (
                0,
                ClientError::Protocol {
                    peer: "self".into(),
                    reason: e,
                },
            )
        };
        let (dtype, shape) =
            petal_proto::tensor::validate(input, usize::MAX).map_err(|e| local(e.to_string()))?;
        let mut x = from_wire(input, dtype, &shape).map_err(|e| local(e.to_string()))?;
        for (i, span) in chain.iter_mut().enumerate() {
            x = span
                .step(&x, *position as usize, timeout)
                .await
                .map_err(|e| (i, e))?;
        }
    }
    Ok(())
}

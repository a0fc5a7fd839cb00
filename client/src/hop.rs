//! The client side of the per-hop protocol: one libp2p stream to one server, one server-side session on it.
//! [`HopClient`] opens the session, sends steps and closes; it knows nothing of chains, history or failover
//! (that is [`crate::chain`]), so the session and the bench speak the protocol through the same code.
use crate::error::{ClientError, Result};
use crate::router::Hop;
use candle_core::Tensor;
use petal_model::compute::wire::{from_wire, to_wire};
use petal_p2p::{ConnectionPath, Network, PeerId, Stream};
use petal_proto::pb::{self, request, response};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// One server's open session.
pub struct HopClient {
    hop: Hop,
    stream: FramedStream<Stream>,
    session_id: u64,
    /// The dtype the server wants hidden states in (its span's input dtype).
    dtype: pb::WireDType,
    /// Whether the stream goes through a circuit relay (no direct connection, even after hole punching).
    relayed: bool,
    /// What the previous server of a route must show to push inputs to this session (empty: the server predates
    /// push).
    push_token: Vec<u8>,
}

/// Where a pushed step's input comes from.
#[derive(Debug, Clone)]
pub enum PushInput {
    /// Sent by the client (the first hop of a pushed step).
    Sent(pb::Tensor),
    /// Pushed by the previous server; the server waits at most `wait` for it. `shape` is what it must be.
    Awaited { shape: Vec<usize>, wait: Duration },
}

/// What one step through a hop returned.
#[derive(Debug, Clone)]
pub struct HopStep {
    /// The hop's output hidden states, `[batch, tokens, hidden]` like its input.
    pub hidden: Tensor,
    /// The input as sent (in the server's wire dtype): what a replacement server is replayed.
    pub sent: pb::Tensor,
    /// Time from sending the step to decoding its answer.
    pub round_trip: Duration,
    /// The server's own compute time for the step, as it reports it.
    pub compute: Duration,
}

impl HopClient {
    /// Opens a stream to `hop`'s server and a session there over `hop.range`, able to hold `max_length` positions.
    pub async fn open(
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
        let relayed = net.connection_path(peer).await == Some(ConnectionPath::Relayed);
        let mut client = Self {
            stream: FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES),
            session_id: 0,
            dtype: pb::WireDType::F32,
            relayed,
            push_token: vec![],
            hop,
        };
        let open = request::Kind::Open(pb::OpenSession {
            protocol_version: PROTOCOL_VERSION,
            model_id: model_id.to_string(),
            start_block: client.hop.range.start as u32,
            end_block: client.hop.range.end as u32,
            max_length: max_length as u32,
            max_batch: 1,
        });
        match client.call(open, timeout).await? {
            response::Kind::Opened(o) => {
                client.session_id = o.session_id;
                client.push_token = o.push_token;
                client.dtype = pb::WireDType::try_from(o.dtype)
                    .map_err(|_| client.protocol("unknown session dtype"))?;
                Ok(client)
            }
            _ => Err(client.protocol("expected SessionOpened")),
        }
    }

    /// The server and the blocks it runs for this session.
    pub fn hop(&self) -> &Hop {
        &self.hop
    }

    /// The dtype the server takes and gives hidden states in.
    pub fn wire_dtype(&self) -> pb::WireDType {
        self.dtype
    }

    /// How the previous server of a route reaches this session to push its inputs; `None` when the server does
    /// not take pushes.
    pub fn push_target(&self) -> Option<pb::PushTarget> {
        (!self.push_token.is_empty()).then(|| pb::PushTarget {
            peer_id: self.hop.record.peer_id.clone(),
            addrs: self.hop.record.addrs.clone(),
            session_id: self.session_id,
            push_token: self.push_token.clone(),
        })
    }

    /// Whether the hop's stream goes through a relay.
    pub fn relayed(&self) -> bool {
        self.relayed
    }

    /// Bytes sent and received on this hop's stream so far.
    pub fn bytes_on_wire(&self) -> u64 {
        self.stream.bytes_sent() + self.stream.bytes_received()
    }

    /// Runs `hidden` for positions `position..` through the hop's blocks: in one protocol step, or, when it holds
    /// more positions (batch x tokens) than the server takes in one (its record's `max_chunk_tokens`), in steps of
    /// that many tokens, in order. `timeout` bounds each of them.
    pub async fn step(
        &mut self,
        hidden: &Tensor,
        position: usize,
        timeout: Duration,
    ) -> Result<HopStep> {
        let sent = to_wire(hidden, self.dtype)?;
        let (batch, tokens, width) = hidden.dims3().map_err(petal_model::ModelError::from)?;
        // The server's announced step size, and never more than one frame carries.
        let fits_frame = petal_proto::tensor::tokens_per_frame(
            self.stream.max_frame_bytes(),
            batch,
            width,
            self.dtype,
        );
        let chunk = match self.hop.record.max_chunk_tokens as usize {
            0 => tokens,
            limit => (limit / batch.max(1)).max(1),
        }
        .min(fits_frame);
        if tokens <= chunk {
            return self.step_wire(sent, position, timeout).await;
        }
        let (mut outs, mut round_trip, mut compute) = (vec![], Duration::ZERO, Duration::ZERO);
        for start in (0..tokens).step_by(chunk) {
            let part = hidden
                .narrow(1, start, chunk.min(tokens - start))
                .map_err(petal_model::ModelError::from)?;
            let out = self
                .step_wire(to_wire(&part, self.dtype)?, position + start, timeout)
                .await?;
            outs.push(out.hidden);
            round_trip += out.round_trip;
            compute += out.compute;
        }
        let hidden = Tensor::cat(&outs, 1).map_err(petal_model::ModelError::from)?;
        Ok(HopStep {
            hidden,
            sent,
            round_trip,
            compute,
        })
    }

    /// [`HopClient::step`] for an input already in wire form (a replay).
    pub async fn step_wire(
        &mut self,
        sent: pb::Tensor,
        position: usize,
        timeout: Duration,
    ) -> Result<HopStep> {
        self.step_push(PushInput::Sent(sent), position, None, timeout)
            .await
    }

    /// One step of a pushed route: the input sent or awaited from the previous server, the output pushed on to
    /// `forward` (the next server) as well as answered here. Never chunked: for steps that fit one protocol step.
    /// A server that got no push in time answers `PUSH_TIMEOUT` ([`ClientError::is_push_timeout`]), its session
    /// unchanged.
    pub async fn step_push(
        &mut self,
        input: PushInput,
        position: usize,
        forward: Option<pb::PushTarget>,
        timeout: Duration,
    ) -> Result<HopStep> {
        let span = tracing::trace_span!("hop_step", blocks = %self.hop.range, position);
        self.exchange(input, position, forward, timeout)
            .instrument(span)
            .await
    }

    async fn exchange(
        &mut self,
        input: PushInput,
        position: usize,
        forward: Option<pb::PushTarget>,
        timeout: Duration,
    ) -> Result<HopStep> {
        let started = Instant::now();
        let (hidden, input_shape, await_push, push_wait_ms) = match &input {
            PushInput::Sent(sent) => (
                Some(sent.clone()),
                sent.shape.iter().map(|&d| d as usize).collect::<Vec<_>>(),
                false,
                0,
            ),
            PushInput::Awaited { shape, wait } => (
                None,
                shape.clone(),
                true,
                u32::try_from(wait.as_millis()).unwrap_or(u32::MAX),
            ),
        };
        let step = request::Kind::Step(pb::Step {
            session_id: self.session_id,
            position: position as u32,
            hidden,
            await_push,
            push_wait_ms,
            forward,
        });
        let result = match self.call(step, timeout).await? {
            response::Kind::Step(s) => s,
            _ => return Err(self.protocol("expected StepResult")),
        };
        let out = result
            .hidden
            .ok_or_else(|| self.protocol("StepResult without hidden states"))?;
        let hidden = self.decode_hidden(&out, &input_shape)?;
        let sent = match input {
            PushInput::Sent(sent) => sent,
            PushInput::Awaited { .. } => {
                let pushed = result
                    .input
                    .ok_or_else(|| self.protocol("pushed StepResult without its input"))?;
                self.decode_hidden(&pushed, &input_shape)?;
                pushed
            }
        };
        Ok(HopStep {
            hidden,
            sent,
            round_trip: started.elapsed(),
            compute: Duration::from_micros(result.compute_micros),
        })
    }

    /// Hidden states a server answered, checked to be `shape`, finite, and decodable.
    fn decode_hidden(&self, t: &pb::Tensor, shape: &[usize]) -> Result<Tensor> {
        let (dtype, got) = petal_proto::tensor::validate(t, shape.iter().product())
            .map_err(|e| self.protocol(&format!("bad hidden states: {e}")))?;
        if got != shape {
            return Err(self.protocol(&format!("answered shape {got:?} for input {shape:?}")));
        }
        petal_proto::tensor::check_finite(dtype, &t.data)
            .map_err(|e| self.protocol(&format!("bad hidden states: {e}")))?;
        Ok(from_wire(t, dtype, &got)?)
    }

    /// Raises the session's `max_length` on the server (which refuses with `CACHE_FULL` when its reservation cannot
    /// grow, leaving the session as it was).
    pub async fn extend(&mut self, max_length: usize, timeout: Duration) -> Result<()> {
        let extend = request::Kind::Extend(pb::ExtendSession {
            session_id: self.session_id,
            max_length: max_length as u32,
        });
        match self.call(extend, timeout).await? {
            response::Kind::Extended(e) if e.max_length as usize >= max_length => Ok(()),
            _ => Err(self.protocol("expected SessionExtended")),
        }
    }

    /// Closes the session (best effort: the server also frees it when the stream ends).
    pub async fn close(mut self, timeout: Duration) {
        let close = request::Kind::Close(pb::CloseSession {
            session_id: self.session_id,
        });
        if let Err(e) = self.call(close, timeout).await {
            tracing::debug!(error = %e, "closing a session failed; the server frees it on disconnect");
        }
        self.stream.close().await;
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
            // A request too large to send is this client's own doing: no server is at fault or could do better.
            self.stream
                .send(&pb::Request { kind: Some(kind) })
                .await
                .map_err(|e| match e {
                    petal_proto::FrameError::TooLarge { len, max } => ClientError::Request(
                        format!("a request of {len} bytes exceeds the frame limit of {max} bytes"),
                    ),
                    other => ClientError::Protocol {
                        peer: peer.clone(),
                        reason: other.to_string(),
                    },
                })?;
            self.stream
                .recv::<pb::Response>()
                .await
                .map_err(|e| ClientError::Protocol {
                    peer: peer.clone(),
                    reason: e.to_string(),
                })
        };
        let reply = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| ClientError::Timeout {
                peer: peer.clone(),
                seconds: timeout.as_secs_f64(),
            })??;
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
}

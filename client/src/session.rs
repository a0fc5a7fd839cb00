//! An inference session over a chain of servers: one libp2p stream and one server-side session per hop, hidden
//! states streamed through them in order.
use crate::error::{ClientError, Result};
use crate::router::Hop;
use candle_core::Tensor;
use petal_model::wire::{from_wire, to_wire};
use petal_p2p::{Network, PeerId, Stream};
use petal_proto::pb::{self, request, response};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION};
use std::time::Duration;

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

/// Hidden states through a chain of servers, position by position.
pub struct InferenceSession {
    spans: Vec<RemoteSpan>,
    position: usize,
    max_length: usize,
    timeout: Duration,
}

impl InferenceSession {
    /// Opens one session per hop of `route`, each able to hold `max_length` positions.
    pub async fn open(
        net: &Network,
        model_id: &str,
        route: Vec<Hop>,
        max_length: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let mut spans = Vec::with_capacity(route.len());
        for hop in route {
            spans.push(RemoteSpan::open(net, model_id, hop, max_length, timeout).await?);
        }
        Ok(Self {
            spans,
            position: 0,
            max_length,
            timeout,
        })
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

    /// Bytes sent and received on all hops' streams so far.
    pub fn bytes_on_wire(&self) -> u64 {
        self.spans
            .iter()
            .map(|s| s.stream.bytes_sent() + s.stream.bytes_received())
            .sum()
    }

    /// Runs `hidden` (`[batch, tokens, hidden]`) for the next positions through every hop; returns the last hop's
    /// output.
    pub async fn step(&mut self, hidden: &Tensor) -> Result<Tensor> {
        let tokens = hidden.dim(1).map_err(petal_model::ModelError::from)?;
        let mut x = hidden.clone();
        for span in &mut self.spans {
            x = span.step(&x, self.position, self.timeout).await?;
        }
        self.position += tokens;
        Ok(x)
    }

    /// Closes every hop's session (best effort: servers also free sessions when the stream ends).
    pub async fn close(self) {
        for span in self.spans {
            span.close(self.timeout).await;
        }
    }
}

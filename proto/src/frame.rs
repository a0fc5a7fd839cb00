//! Length-delimited frames: a 4-byte big-endian length, then that many bytes of one prost-encoded message.
//!
//! A fixed-width prefix (rather than protobuf's varint delimiting) lets a reader learn the announced length from
//! exactly 4 bytes and refuse an oversized frame before reading or allocating anything for its body.
//!
//! The pure [`encode_frame`] / [`decode_frame`] do no I/O, so they can be fuzzed; [`FramedStream`] applies the same
//! rules to a futures-io stream (what libp2p hands out).
//!
//! The size limit bounds the announced length, i.e. the message bytes; the 4 prefix bytes are not counted.

use bytes::{BufMut, Bytes, BytesMut};
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use prost::Message;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::pb;

/// Bytes in the length prefix.
pub const PREFIX_LEN: usize = 4;

/// First buffer size when reading a frame body. The buffer then doubles (never beyond the announced length) as
/// bytes actually arrive, so a peer that announces a large frame and stalls costs us at most this much.
const INITIAL_BODY_CHUNK: usize = 64 * 1024;

/// Why a frame could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The underlying stream failed.
    #[error("stream i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The announced (or, when sending, actual) message length exceeds the limit. On receive the body is left
    /// unread, so the stream is out of sync and must be closed after answering with an error.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    /// The input ended inside a frame: `got` bytes of a frame that needs `expected` (prefix included).
    #[error("truncated frame: expected {expected} bytes, got {got}")]
    Truncated { expected: usize, got: usize },
    /// A frame whose first byte arrived was not complete `seconds` later (a peer dripping a large frame).
    #[error("frame not complete within {seconds} s ({got} bytes received)")]
    Timeout { seconds: f64, got: usize },
    /// The frame was complete but its bytes are not a valid message of the expected type.
    #[error("malformed message: {0}")]
    Decode(#[from] prost::DecodeError),
}

impl FrameError {
    /// The error code a server answers this failure with, or `None` when the stream is unusable (I/O failure or
    /// truncation: there is nobody left to answer).
    pub fn error_code(&self) -> Option<pb::ErrorCode> {
        match self {
            FrameError::TooLarge { .. } => Some(pb::ErrorCode::FrameTooLarge),
            FrameError::Decode(_) => Some(pb::ErrorCode::BadRequest),
            FrameError::Io(_) | FrameError::Truncated { .. } | FrameError::Timeout { .. } => None,
        }
    }

    /// Whether the stream can still carry frames after this error. Only a `Decode` error leaves it in sync (the
    /// whole frame was consumed); after anything else the caller must close it.
    pub fn is_recoverable(&self) -> bool {
        matches!(self, FrameError::Decode(_))
    }
}

/// Encodes `msg` as one frame: 4-byte big-endian length, then the message bytes.
///
/// # Panics
/// If the message is 4 GiB or larger, which no length prefix can describe. Use [`encode_frame_checked`] where the
/// message size is not under the caller's control.
pub fn encode_frame<M: Message>(msg: &M) -> Bytes {
    match encode_frame_checked(msg, u32::MAX as usize) {
        Ok(frame) => frame,
        Err(e) => panic!("cannot frame message: {e}"),
    }
}

/// Encodes `msg` as one frame, refusing with [`FrameError::TooLarge`] a message longer than `max` bytes (and in any
/// case one longer than `u32::MAX`).
pub fn encode_frame_checked<M: Message>(msg: &M, max: usize) -> Result<Bytes, FrameError> {
    let len = msg.encoded_len();
    let max = max.min(u32::MAX as usize);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut buf = BytesMut::with_capacity(PREFIX_LEN + len);
    // `len <= u32::MAX` was checked above, so the cast is lossless.
    buf.put_u32(len as u32);
    // `encode` fails only when the buffer cannot grow enough; BytesMut grows on demand and holds `len` spare bytes.
    let encoded = msg.encode(&mut buf);
    debug_assert!(encoded.is_ok());
    Ok(buf.freeze())
}

/// Decodes the frame at the start of `buf`, returning the message and the bytes consumed (prefix + body).
///
/// Never panics and allocates nothing for the body beyond what the message itself holds:
/// - fewer than 4 bytes, or fewer than 4 + announced length: [`FrameError::Truncated`] (`expected` is what a full
///   frame needs, so a caller buffering a byte stream knows how much more to wait for);
/// - announced length over `max`: [`FrameError::TooLarge`], decided from the prefix alone;
/// - body not a valid `M`: [`FrameError::Decode`].
pub fn decode_frame<M: Message + Default>(
    buf: &[u8],
    max: usize,
) -> Result<(M, usize), FrameError> {
    let Some(prefix) = buf.first_chunk::<PREFIX_LEN>() else {
        return Err(FrameError::Truncated {
            expected: PREFIX_LEN,
            got: buf.len(),
        });
    };
    let len = u32::from_be_bytes(*prefix) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let total = PREFIX_LEN.saturating_add(len);
    let Some(body) = buf.get(PREFIX_LEN..total) else {
        return Err(FrameError::Truncated {
            expected: total,
            got: buf.len(),
        });
    };
    let msg = M::decode(body)?;
    Ok((msg, total))
}

/// Bounds on the bytes a reader may hold in frames not yet handled, shared by many streams: each pool is a
/// semaphore of bytes (a node gives every stream its peer's pool and the node-wide one). A stream takes bytes from
/// every pool as its body buffer grows and gives them back when the next frame is asked for, so the bytes of the
/// frame being handled stay counted too. A stream that cannot get bytes waits (the peer's bytes stay in the
/// transport's bounded windows) until others give some back or its frame deadline passes.
#[derive(Debug, Clone, Default)]
pub struct RecvBudget {
    pools: Vec<Arc<Semaphore>>,
}

impl RecvBudget {
    /// Takes bytes from each of `pools`, in order.
    pub fn new(pools: Vec<Arc<Semaphore>>) -> Self {
        Self { pools }
    }

    /// A pool of `bytes` (at most [`Semaphore::MAX_PERMITS`]).
    pub fn pool(bytes: usize) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS)))
    }

    async fn take(&self, bytes: usize, held: &mut Vec<OwnedSemaphorePermit>) {
        let Ok(n) = u32::try_from(bytes) else {
            return;
        };
        for pool in &self.pools {
            // A pool is never closed, so acquiring fails only if it were; then it bounds nothing.
            if let Ok(permit) = pool.clone().acquire_many_owned(n).await {
                held.push(permit);
            }
        }
    }
}

/// What a reader allows a peer: how long one frame may take to arrive once its first byte has, and the byte pools
/// its unhandled frames draw from. The default bounds nothing (a client reading its servers' answers).
#[derive(Debug, Clone, Default)]
pub struct RecvLimits {
    pub frame_timeout: Option<Duration>,
    pub budget: RecvBudget,
}

/// The frame being read: kept in the stream, so a `recv` cancelled at an await point (a `select!` that chose
/// another branch) loses nothing and the next `recv` goes on where it stopped.
#[derive(Debug, Default)]
struct Partial {
    prefix: [u8; PREFIX_LEN],
    prefix_got: usize,
    body: Vec<u8>,
    filled: usize,
    /// When its first byte arrived (the frame deadline counts from then).
    started: Option<Instant>,
    permits: Vec<OwnedSemaphorePermit>,
}

/// A futures-io byte stream carrying frames both ways, with byte counters for wire-cost accounting.
///
/// Errors and stream state:
/// - `Decode` on [`recv`](Self::recv): the frame was fully consumed, the stream is still in sync; a server answers
///   `BAD_REQUEST` and may go on.
/// - `TooLarge` on `recv`: the body was NOT read, so the stream is out of sync. The caller must answer with
///   `FRAME_TOO_LARGE` (sending still works) and then [`close`](Self::close) the stream; a further `recv` would
///   misread body bytes as a prefix.
/// - `Truncated`, `Timeout` or `Io`: the stream is finished; drop it.
pub struct FramedStream<S> {
    inner: S,
    max_frame_bytes: usize,
    limits: RecvLimits,
    partial: Partial,
    /// Budget bytes of the last frame returned, given back at the next `recv`.
    held: Vec<OwnedSemaphorePermit>,
    bytes_sent: u64,
    bytes_received: u64,
}

impl<S> FramedStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Wraps `stream`; frames announcing (or sending) more than `max_frame_bytes` message bytes are refused.
    pub fn new(stream: S, max_frame_bytes: usize) -> Self {
        Self {
            inner: stream,
            max_frame_bytes,
            limits: RecvLimits::default(),
            partial: Partial::default(),
            held: Vec::new(),
            bytes_sent: 0,
            bytes_received: 0,
        }
    }

    /// Applies `limits` to the frames received from now on.
    pub fn with_limits(mut self, limits: RecvLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Encodes, writes and flushes one frame. A message over the limit is refused with `TooLarge` before
    /// anything is written, so the stream stays usable.
    pub async fn send<M: Message>(&mut self, msg: &M) -> Result<(), FrameError> {
        let frame = encode_frame_checked(msg, self.max_frame_bytes)?;
        self.inner.write_all(&frame).await?;
        self.bytes_sent += frame.len() as u64;
        self.inner.flush().await?;
        Ok(())
    }

    /// Reads one frame and decodes it.
    ///
    /// `Ok(None)` when the peer closed the stream cleanly between frames; `Truncated` when it closed inside one;
    /// `Timeout` when a frame whose first byte arrived is not complete within the limits' frame timeout. The
    /// announced length is checked against the limit before any body byte is read, and the body buffer grows only
    /// as bytes arrive (drawing on the limits' budget), never beyond the announced length.
    ///
    /// Cancellation-safe: the bytes of a frame read so far stay in the stream.
    pub async fn recv<M: Message + Default>(&mut self) -> Result<Option<M>, FrameError> {
        self.held.clear();
        let Some(len) = self.read_frame().await? else {
            return Ok(None);
        };
        let done = std::mem::take(&mut self.partial);
        self.held = done.permits;
        Ok(Some(M::decode(&done.body[..len])?))
    }

    /// Reads the pending frame's prefix and body into `self.partial`; its body length, or `None` at a clean end.
    async fn read_frame(&mut self) -> Result<Option<usize>, FrameError> {
        let frame_timeout = self.limits.frame_timeout;
        let deadline = |p: &Partial| p.started.zip(frame_timeout).map(|(t, d)| t + d);
        let p = &mut self.partial;
        while p.prefix_got < PREFIX_LEN {
            let at = deadline(p);
            let n = match read_before(&mut self.inner, &mut p.prefix[p.prefix_got..], at).await {
                Ok(n) => n,
                Err(Some(e)) => return Err(e.into()),
                Err(None) => return Err(timeout(p, frame_timeout)),
            };
            if n == 0 {
                if p.prefix_got == 0 {
                    return Ok(None);
                }
                return Err(FrameError::Truncated {
                    expected: PREFIX_LEN,
                    got: p.prefix_got,
                });
            }
            p.started.get_or_insert_with(Instant::now);
            p.prefix_got += n;
            self.bytes_received += n as u64;
        }
        let len = u32::from_be_bytes(p.prefix) as usize;
        if len > self.max_frame_bytes {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame_bytes,
            });
        }
        while p.filled < len {
            if p.filled == p.body.len() {
                // Double the buffer (starting at INITIAL_BODY_CHUNK), capped at the announced length; the budget
                // pays for it first.
                let grow = p.body.len().max(INITIAL_BODY_CHUNK).min(len - p.body.len());
                let mut permits = Vec::new();
                let take = self.limits.budget.take(grow, &mut permits);
                if within(deadline(p), take).await.is_err() {
                    return Err(timeout(p, frame_timeout));
                }
                p.permits.append(&mut permits);
                p.body.reserve_exact(grow);
                p.body.resize(p.body.len() + grow, 0);
            }
            let at = deadline(p);
            let n = match read_before(&mut self.inner, &mut p.body[p.filled..], at).await {
                Ok(n) => n,
                Err(Some(e)) => return Err(e.into()),
                Err(None) => return Err(timeout(p, frame_timeout)),
            };
            if n == 0 {
                return Err(FrameError::Truncated {
                    expected: PREFIX_LEN + len,
                    got: PREFIX_LEN + p.filled,
                });
            }
            p.filled += n;
            self.bytes_received += n as u64;
        }
        Ok(Some(len))
    }

    /// Flushes and closes the write side. Best effort: a failure here means the peer is already gone, which is
    /// what closing wanted anyway, so it is not reported.
    pub async fn close(&mut self) {
        let _ = self.inner.close().await;
    }

    /// Gives back the underlying stream (e.g. to hand it on or drop it without closing).
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Frame bytes written so far, prefixes included.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Bytes read so far, prefixes included (also those of a frame that then failed to decode).
    pub fn bytes_received(&self) -> u64 {
        self.bytes_received
    }

    /// The limit on a frame's message bytes.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// The underlying stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// `fut`, or `Err(())` once `deadline` passes (never without one).
async fn within<T>(deadline: Option<Instant>, fut: impl Future<Output = T>) -> Result<T, ()> {
    match deadline {
        Some(at) => tokio::time::timeout_at(at.into(), fut)
            .await
            .map_err(|_| ()),
        None => Ok(fut.await),
    }
}

/// Reads some bytes into `buf` before `deadline` (retrying interrupted reads): how many, or the I/O error, or
/// `None` when the deadline passed.
async fn read_before<S: AsyncRead + Unpin>(
    inner: &mut S,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> Result<usize, Option<std::io::Error>> {
    loop {
        match within(deadline, inner.read(buf)).await {
            Ok(Ok(n)) => return Ok(n),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(Err(e)) => return Err(Some(e)),
            Err(()) => return Err(None),
        }
    }
}

fn timeout(p: &Partial, frame_timeout: Option<Duration>) -> FrameError {
    FrameError::Timeout {
        seconds: frame_timeout.unwrap_or_default().as_secs_f64(),
        got: p.prefix_got + p.filled,
    }
}

#[cfg(test)]
mod tests;

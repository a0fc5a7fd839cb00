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
            FrameError::Io(_) | FrameError::Truncated { .. } => None,
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

/// A futures-io byte stream carrying frames both ways, with byte counters for wire-cost accounting.
///
/// Errors and stream state:
/// - `Decode` on [`recv`](Self::recv): the frame was fully consumed, the stream is still in sync; a server answers
///   `BAD_REQUEST` and may go on.
/// - `TooLarge` on `recv`: the body was NOT read, so the stream is out of sync. The caller must answer with
///   `FRAME_TOO_LARGE` (sending still works) and then [`close`](Self::close) the stream; a further `recv` would
///   misread body bytes as a prefix.
/// - `Truncated` or `Io`: the stream is finished; drop it.
pub struct FramedStream<S> {
    inner: S,
    max_frame_bytes: usize,
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
            bytes_sent: 0,
            bytes_received: 0,
        }
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
    /// `Ok(None)` when the peer closed the stream cleanly between frames; `Truncated` when it closed inside one.
    /// The announced length is checked against the limit before any body byte is read, and the body buffer grows
    /// only as bytes arrive, never beyond the announced length.
    pub async fn recv<M: Message + Default>(&mut self) -> Result<Option<M>, FrameError> {
        let mut prefix = [0u8; PREFIX_LEN];
        let got = self.read_some(&mut prefix).await?;
        if got == 0 {
            return Ok(None);
        }
        if got < PREFIX_LEN {
            return Err(FrameError::Truncated {
                expected: PREFIX_LEN,
                got,
            });
        }
        let len = u32::from_be_bytes(prefix) as usize;
        if len > self.max_frame_bytes {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame_bytes,
            });
        }

        let mut body: Vec<u8> = Vec::new();
        let mut filled = 0;
        while filled < len {
            if filled == body.len() {
                // Double the buffer (starting at INITIAL_BODY_CHUNK), capped at the announced length.
                let grow = body.len().max(INITIAL_BODY_CHUNK).min(len - body.len());
                body.reserve_exact(grow);
                body.resize(body.len() + grow, 0);
            }
            let n = self.read_some(&mut body[filled..]).await?;
            if n == 0 {
                return Err(FrameError::Truncated {
                    expected: PREFIX_LEN + len,
                    got: PREFIX_LEN + filled,
                });
            }
            filled += n;
        }
        Ok(Some(M::decode(&body[..])?))
    }

    /// Fills `buf` unless EOF comes first; returns the bytes read (less than `buf.len()` only at EOF).
    async fn read_some(&mut self, buf: &mut [u8]) -> Result<usize, FrameError> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.inner.read(&mut buf[filled..]).await {
                Ok(0) => break,
                Ok(n) => {
                    filled += n;
                    self.bytes_received += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(filled)
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

#[cfg(test)]
mod tests;

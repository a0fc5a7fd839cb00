use std::pin::Pin;
use std::task::{Context, Poll};

use futures::executor::block_on;
use futures::io::Cursor;
use tokio_util::compat::TokioAsyncReadCompatExt;

use super::*;
use crate::pb::{request, response};
use crate::tensor::from_f32;

fn hidden() -> pb::Tensor {
    from_f32(
        &[0.5, -1.25, 3.0, 0.0, 7.5, -0.125],
        &[1, 2, 3],
        pb::WireDType::F32,
    )
}

fn sample_record() -> pb::ServerRecord {
    pb::ServerRecord {
        record_version: crate::RECORD_VERSION,
        model_id: "sha256:abcd".into(),
        model_name: "tiny-llama".into(),
        num_blocks: 22,
        peer_id: "12D3KooW...".into(),
        addrs: vec!["/ip4/127.0.0.1/tcp/4001".into()],
        start_block: 0,
        end_block: 11,
        dtype: pb::WireDType::Bf16 as i32,
        quantization: "none".into(),
        throughput_tokens_per_sec: 12.5,
        cache_tokens_free: 1000,
        cache_tokens_total: 4096,
        petal_version: "0.1.0".into(),
        public_name: "alice".into(),
        reachability: "public".into(),
        relay: true,
        devices: vec![pb::DeviceInfo {
            device: "cuda:0".into(),
            start_block: 0,
            end_block: 11,
            free_memory_bytes: 1 << 30,
            total_memory_bytes: 1 << 34,
        }],
        updated_unix_ms: 1_700_000_000_000,
        ttl_ms: 90_000,
        withdrawn: false,
        sessions_open: 3,
        block_hashes: vec!["ab".repeat(32); 11],
        max_chunk_tokens: 512,
        memory_budget_bytes: 6 << 30,
        weight_bytes: 3 << 30,
        kv_position_bytes: 1 << 17,
    }
}

fn all_requests() -> Vec<pb::Request> {
    let kinds = vec![
        request::Kind::Open(pb::OpenSession {
            protocol_version: crate::PROTOCOL_VERSION,
            model_id: "sha256:abcd".into(),
            start_block: 2,
            end_block: 7,
            max_length: 512,
            max_batch: 2,
        }),
        request::Kind::Extend(pb::ExtendSession {
            session_id: 42,
            max_length: 1024,
        }),
        request::Kind::Step(pb::Step {
            session_id: 42,
            position: 17,
            hidden: Some(hidden()),
            ..Default::default()
        }),
        request::Kind::Close(pb::CloseSession { session_id: 42 }),
        request::Kind::Info(pb::InfoRequest {}),
    ];
    kinds
        .into_iter()
        .map(|k| pb::Request { kind: Some(k) })
        .collect()
}

fn all_responses() -> Vec<pb::Response> {
    let kinds = vec![
        response::Kind::Opened(pb::SessionOpened {
            session_id: 42,
            start_block: 2,
            end_block: 7,
            dtype: pb::WireDType::F16 as i32,
            max_length: 512,
            ..Default::default()
        }),
        response::Kind::Step(pb::StepResult {
            session_id: 42,
            position: 17,
            hidden: Some(hidden()),
            compute_micros: 1234,
            ..Default::default()
        }),
        response::Kind::Closed(pb::SessionClosed { session_id: 42 }),
        response::Kind::Extended(pb::SessionExtended {
            session_id: 42,
            max_length: 1024,
        }),
        response::Kind::Info(sample_record()),
    ];
    let mut out: Vec<pb::Response> = kinds
        .into_iter()
        .map(|k| pb::Response { kind: Some(k) })
        .collect();
    out.push(pb::Response::error(
        pb::ErrorCode::UnknownSession,
        "no session 9",
    ));
    out
}

#[test]
fn every_request_kind_round_trips() {
    for req in all_requests() {
        let frame = encode_frame(&req);
        let (back, used) = decode_frame::<pb::Request>(&frame, DEFAULT_MAX).unwrap();
        assert_eq!(back, req);
        assert_eq!(used, frame.len());
        assert_eq!(
            u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize,
            frame.len() - 4
        );
    }
}

#[test]
fn every_response_kind_round_trips() {
    for resp in all_responses() {
        let frame = encode_frame(&resp);
        let (back, used) = decode_frame::<pb::Response>(&frame, DEFAULT_MAX).unwrap();
        assert_eq!(back, resp);
        assert_eq!(used, frame.len());
    }
}

const DEFAULT_MAX: usize = crate::DEFAULT_MAX_FRAME_BYTES;

#[test]
fn empty_message_is_a_bare_prefix() {
    let frame = encode_frame(&pb::Request::default());
    assert_eq!(&frame[..], &[0, 0, 0, 0]);
    let (back, used) = decode_frame::<pb::Request>(&frame, 0).unwrap();
    assert_eq!(back, pb::Request::default());
    assert_eq!(used, 4);
}

#[test]
fn consecutive_frames_decode_one_at_a_time() {
    let reqs = all_requests();
    let mut buf = Vec::new();
    for r in &reqs {
        buf.extend_from_slice(&encode_frame(r));
    }
    let mut at = 0;
    for r in &reqs {
        let (back, used) = decode_frame::<pb::Request>(&buf[at..], DEFAULT_MAX).unwrap();
        assert_eq!(&back, r);
        at += used;
    }
    assert_eq!(at, buf.len());
}

#[test]
fn prefix_cut_is_truncated() {
    let frame = encode_frame(&all_requests()[0]);
    for cut in 0..4 {
        match decode_frame::<pb::Request>(&frame[..cut], DEFAULT_MAX) {
            Err(FrameError::Truncated { expected: 4, got }) => assert_eq!(got, cut),
            other => panic!("cut {cut}: {other:?}"),
        }
    }
}

#[test]
fn body_cut_is_truncated() {
    let frame = encode_frame(&all_requests()[1]);
    for cut in 4..frame.len() {
        match decode_frame::<pb::Request>(&frame[..cut], DEFAULT_MAX) {
            Err(FrameError::Truncated { expected, got }) => {
                assert_eq!(expected, frame.len());
                assert_eq!(got, cut);
            }
            other => panic!("cut {cut}: {other:?}"),
        }
    }
}

#[test]
fn oversized_prefix_is_refused_from_the_prefix_alone() {
    // Only the prefix is present: the decoder must not wait for (or allocate) the announced 4 GiB.
    let buf = [0xFF, 0xFF, 0xFF, 0xFF];
    match decode_frame::<pb::Request>(&buf, DEFAULT_MAX) {
        Err(FrameError::TooLarge { len, max }) => {
            assert_eq!(len, u32::MAX as usize);
            assert_eq!(max, DEFAULT_MAX);
        }
        other => panic!("{other:?}"),
    }
    // Exactly at the limit is fine, one above is not.
    let frame = encode_frame(&all_requests()[0]);
    let body = frame.len() - 4;
    assert!(decode_frame::<pb::Request>(&frame, body).is_ok());
    assert!(matches!(
        decode_frame::<pb::Request>(&frame, body - 1),
        Err(FrameError::TooLarge { .. })
    ));
}

#[test]
fn garbage_body_is_a_decode_error() {
    // Field 1 (oneof `open`) as length-delimited with a length running past the body.
    let mut buf = vec![0, 0, 0, 3, 0x0A, 0x7F, 0x00];
    assert!(matches!(
        decode_frame::<pb::Request>(&buf, DEFAULT_MAX),
        Err(FrameError::Decode(_))
    ));
    // Field number 0 is invalid in protobuf.
    buf = vec![0, 0, 0, 2, 0x00, 0x01];
    let err = decode_frame::<pb::Request>(&buf, DEFAULT_MAX).unwrap_err();
    assert!(matches!(err, FrameError::Decode(_)));
    assert_eq!(err.error_code(), Some(pb::ErrorCode::BadRequest));
    assert!(err.is_recoverable());
    // Invalid wire type 7.
    buf = vec![0, 0, 0, 1, 0x0F];
    assert!(matches!(
        decode_frame::<pb::Response>(&buf, DEFAULT_MAX),
        Err(FrameError::Decode(_))
    ));
}

#[test]
fn checked_encode_refuses_oversized_messages() {
    let req = &all_requests()[1];
    let body = req.encoded_len();
    assert!(encode_frame_checked(req, body).is_ok());
    match encode_frame_checked(req, body - 1) {
        Err(e @ FrameError::TooLarge { .. }) => {
            assert_eq!(e.error_code(), Some(pb::ErrorCode::FrameTooLarge));
            assert!(!e.is_recoverable());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn error_messages_are_clear() {
    let e = FrameError::TooLarge { len: 10, max: 5 };
    assert_eq!(e.to_string(), "frame of 10 bytes exceeds the 5-byte limit");
    let e = FrameError::Truncated {
        expected: 10,
        got: 3,
    };
    assert_eq!(e.to_string(), "truncated frame: expected 10 bytes, got 3");
}

// ---- FramedStream ----

fn frames(msgs: &[pb::Request]) -> Vec<u8> {
    msgs.iter().flat_map(|m| encode_frame(m).to_vec()).collect()
}

#[test]
fn stream_reads_frames_then_none_at_clean_eof() {
    let reqs = all_requests();
    let bytes = frames(&reqs);
    let total = bytes.len() as u64;
    let mut s = FramedStream::new(Cursor::new(bytes), DEFAULT_MAX);
    block_on(async {
        for r in &reqs {
            assert_eq!(s.recv::<pb::Request>().await.unwrap().as_ref(), Some(r));
        }
        assert!(s.recv::<pb::Request>().await.unwrap().is_none());
        // EOF is sticky.
        assert!(s.recv::<pb::Request>().await.unwrap().is_none());
    });
    assert_eq!(s.bytes_received(), total);
    assert_eq!(s.bytes_sent(), 0);
}

#[test]
fn stream_eof_inside_prefix_is_truncated() {
    let mut bytes = frames(&all_requests()[..1]);
    bytes.extend_from_slice(&[0, 0]);
    let mut s = FramedStream::new(Cursor::new(bytes), DEFAULT_MAX);
    block_on(async {
        assert!(s.recv::<pb::Request>().await.unwrap().is_some());
        match s.recv::<pb::Request>().await {
            Err(FrameError::Truncated {
                expected: 4,
                got: 2,
            }) => {}
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn stream_eof_inside_body_is_truncated() {
    let full = frames(&all_requests()[1..2]);
    let cut = full.len() - 3;
    let mut s = FramedStream::new(Cursor::new(full[..cut].to_vec()), DEFAULT_MAX);
    match block_on(s.recv::<pb::Request>()) {
        Err(FrameError::Truncated { expected, got }) => {
            assert_eq!(expected, full.len());
            assert_eq!(got, cut);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn stream_refuses_oversized_prefix_without_reading_body() {
    // Announces 1 MiB, limit is 1 KiB; the rest of the stream must stay unread.
    let mut bytes = (1u32 << 20).to_be_bytes().to_vec();
    bytes.extend_from_slice(&[0xAB; 16]);
    let mut s = FramedStream::new(Cursor::new(bytes), 1024);
    match block_on(s.recv::<pb::Request>()) {
        Err(FrameError::TooLarge { len, max }) => {
            assert_eq!(len, 1 << 20);
            assert_eq!(max, 1024);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.bytes_received(), 4);
    assert_eq!(s.into_inner().position(), 4);
}

#[test]
fn stream_decode_error_keeps_stream_in_sync() {
    let mut bytes = vec![0, 0, 0, 1, 0x0F];
    bytes.extend(frames(&all_requests()[3..4]));
    let mut s = FramedStream::new(Cursor::new(bytes), DEFAULT_MAX);
    block_on(async {
        assert!(matches!(
            s.recv::<pb::Request>().await,
            Err(FrameError::Decode(_))
        ));
        assert_eq!(
            s.recv::<pb::Request>().await.unwrap(),
            Some(all_requests()[3].clone())
        );
    });
}

#[test]
fn stream_send_counts_bytes_and_refuses_oversized() {
    let mut s = FramedStream::new(Cursor::new(Vec::new()), 64);
    let small = pb::Request {
        kind: Some(request::Kind::Close(pb::CloseSession { session_id: 1 })),
    };
    let big = pb::Request {
        kind: Some(request::Kind::Step(pb::Step {
            session_id: 1,
            position: 0,
            hidden: Some(from_f32(&[1.0; 64], &[1, 1, 64], pb::WireDType::F32)),
            ..Default::default()
        })),
    };
    block_on(async {
        s.send(&small).await.unwrap();
        assert!(matches!(
            s.send(&big).await,
            Err(FrameError::TooLarge { max: 64, .. })
        ));
    });
    let expected = encode_frame(&small);
    assert_eq!(s.bytes_sent(), expected.len() as u64);
    // Nothing of the refused frame was written.
    assert_eq!(s.into_inner().into_inner(), expected.to_vec());
}

/// A reader that hands out one byte per read, with an `Interrupted` error before each: frames must still
/// reassemble.
struct Dribble {
    data: Vec<u8>,
    at: usize,
    interrupt: bool,
}

impl AsyncRead for Dribble {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        self.interrupt = !self.interrupt;
        if self.interrupt {
            return Poll::Ready(Err(std::io::ErrorKind::Interrupted.into()));
        }
        if self.at >= self.data.len() || buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        buf[0] = self.data[self.at];
        self.at += 1;
        Poll::Ready(Ok(1))
    }
}

impl AsyncWrite for Dribble {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[test]
fn stream_reassembles_byte_by_byte_reads() {
    let reqs = all_requests();
    let data = frames(&reqs);
    let mut s = FramedStream::new(
        Dribble {
            data,
            at: 0,
            interrupt: false,
        },
        DEFAULT_MAX,
    );
    block_on(async {
        for r in &reqs {
            assert_eq!(s.recv::<pb::Request>().await.unwrap().as_ref(), Some(r));
        }
        assert!(s.recv::<pb::Request>().await.unwrap().is_none());
    });
}

#[test]
fn stream_body_larger_than_first_chunk() {
    // Bigger than INITIAL_BODY_CHUNK so the body buffer has to grow several times.
    let n = 3 * INITIAL_BODY_CHUNK / 4 + 17;
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let req = pb::Request {
        kind: Some(request::Kind::Step(pb::Step {
            session_id: 5,
            position: 0,
            hidden: Some(from_f32(&values, &[1, 1, n], pb::WireDType::F32)),
            ..Default::default()
        })),
    };
    let mut s = FramedStream::new(Cursor::new(encode_frame(&req).to_vec()), DEFAULT_MAX);
    assert_eq!(block_on(s.recv::<pb::Request>()).unwrap(), Some(req));
}

#[tokio::test]
async fn duplex_request_response_exchange() {
    let (a, b) = tokio::io::duplex(1024);
    let mut client = FramedStream::new(a.compat(), DEFAULT_MAX);
    let mut server = FramedStream::new(b.compat(), DEFAULT_MAX);

    let server_task = tokio::spawn(async move {
        let mut served = 0u32;
        while let Some(req) = server.recv::<pb::Request>().await.unwrap() {
            let resp = match req.kind {
                Some(request::Kind::Step(step)) => pb::Response {
                    kind: Some(response::Kind::Step(pb::StepResult {
                        session_id: step.session_id,
                        position: step.position,
                        hidden: step.hidden,
                        compute_micros: 1,
                        ..Default::default()
                    })),
                },
                _ => pb::Response::error(pb::ErrorCode::BadRequest, "only steps here"),
            };
            server.send(&resp).await.unwrap();
            served += 1;
        }
        server.close().await;
        (served, server.bytes_received(), server.bytes_sent())
    });

    for i in 0..20u32 {
        let step = pb::Step {
            session_id: 9,
            position: i,
            // Bigger than the duplex buffer, so reads and writes really interleave.
            hidden: Some(from_f32(
                &vec![i as f32; 700],
                &[1, 1, 700],
                pb::WireDType::Bf16,
            )),
            ..Default::default()
        };
        client
            .send(&pb::Request {
                kind: Some(request::Kind::Step(step.clone())),
            })
            .await
            .unwrap();
        match client.recv::<pb::Response>().await.unwrap().unwrap().kind {
            Some(response::Kind::Step(r)) => {
                assert_eq!(r.position, i);
                assert_eq!(r.hidden, step.hidden);
            }
            other => panic!("{other:?}"),
        }
    }
    client.send(&pb::Request::default()).await.unwrap();
    let resp = client.recv::<pb::Response>().await.unwrap().unwrap();
    assert_eq!(
        resp,
        pb::Response::error(pb::ErrorCode::BadRequest, "only steps here")
    );
    client.close().await;

    let (served, srv_rx, srv_tx) = server_task.await.unwrap();
    assert_eq!(served, 21);
    assert_eq!(srv_rx, client.bytes_sent());
    assert_eq!(srv_tx, client.bytes_received());
    // The server closed its side: the client now sees a clean EOF.
    assert!(client.recv::<pb::Response>().await.unwrap().is_none());
}

/// A frame announced in full and then delivered a byte at a time is given up `frame_timeout` after its first byte.
#[tokio::test]
async fn a_dripped_frame_times_out() {
    use tokio::io::AsyncWriteExt as _;
    let (mut writer, reader) = tokio::io::duplex(1 << 16);
    let limits = RecvLimits {
        frame_timeout: Some(Duration::from_millis(500)),
        budget: RecvBudget::default(),
    };
    let mut server = FramedStream::new(reader.compat(), DEFAULT_MAX).with_limits(limits);
    // A stream idle between frames has no deadline: a whole frame sent after longer than the timeout arrives.
    let frame = encode_frame(&pb::Request::default());
    let late = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        writer.write_all(&frame).await.unwrap();
    };
    let (received, ()) = tokio::join!(server.recv::<pb::Request>(), late);
    assert_eq!(received.unwrap(), Some(pb::Request::default()));
    // A frame announcing 200 bytes and dripping one every 50 ms is given up 500 ms after its first byte.
    writer.write_all(&[0, 0, 0, 200]).await.unwrap();
    let drip = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if writer.write_all(&[8]).await.is_err() {
                break;
            }
        }
    });
    let started = std::time::Instant::now();
    match server.recv::<pb::Request>().await {
        Err(FrameError::Timeout { seconds, got }) => {
            assert_eq!(seconds, 0.5);
            assert!((4..=20).contains(&got), "{got} bytes");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(FrameError::Timeout {
        seconds: 0.5,
        got: 4
    }
    .error_code()
    .is_none());
    drop(server);
    drip.await.unwrap();
}

/// Two streams sharing a pool that holds one frame: the second frame waits until the first stream asks for its
/// next one (the first frame was handled), then arrives whole.
#[tokio::test]
async fn streams_sharing_a_budget_wait_for_each_other() {
    let request = pb::Request {
        kind: Some(request::Kind::Step(pb::Step {
            session_id: 1,
            position: 0,
            hidden: Some(from_f32(
                &vec![0.25; 40_000],
                &[1, 1, 40_000],
                pb::WireDType::F32,
            )),
            ..Default::default()
        })),
    };
    let frame = encode_frame(&request);
    let pool = RecvBudget::pool(200_000);
    let limits = RecvLimits {
        frame_timeout: None,
        budget: RecvBudget::new(vec![pool.clone()]),
    };
    let mut streams = vec![];
    for _ in 0..2 {
        let (mut writer, reader) = tokio::io::duplex(1 << 20);
        use tokio::io::AsyncWriteExt as _;
        writer.write_all(&frame).await.unwrap();
        streams.push((
            writer,
            FramedStream::new(reader.compat(), DEFAULT_MAX).with_limits(limits.clone()),
        ));
    }
    let (_w1, mut first) = streams.remove(0);
    let (_w2, mut second) = streams.remove(0);
    assert_eq!(
        first.recv::<pb::Request>().await.unwrap().as_ref(),
        Some(&request)
    );
    // The first frame's bytes are still counted: the second cannot complete.
    assert!(pool.available_permits() < 200_000 - 160_000 + 1);
    let waiting =
        tokio::time::timeout(Duration::from_millis(200), second.recv::<pb::Request>()).await;
    assert!(waiting.is_err(), "the second frame fit beside the first");
    // The first stream moves on (its peer closed): its frame's bytes go back, and the second frame completes,
    // from where its cancelled recv left it.
    drop(_w1);
    assert!(first.recv::<pb::Request>().await.unwrap().is_none());
    assert_eq!(
        second.recv::<pb::Request>().await.unwrap().as_ref(),
        Some(&request)
    );
    drop(second);
    drop(first);
    assert_eq!(pool.available_permits(), 200_000);
}

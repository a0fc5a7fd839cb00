//! Hostile and malformed input against the server's request state machine and its stream handler: each gets a
//! typed error, other sessions keep working, and nothing leaks.
mod common;

use common::{code, opened};

use candle_core::{DType, Device, Tensor};
use petal_model::compute::wire::to_wire;
use petal_model::BlockRange;
use petal_node::handler::StreamState;
use petal_node::ServerContext;
use petal_p2p::PeerId;
use petal_proto::pb::{self, request, response, ErrorCode};
use std::sync::Arc;

const HIDDEN: usize = 64;

/// A server context over all 5 blocks of stories260K, with a cache budget of `cache_tokens`.
fn context(cache_tokens: usize, max_sessions: usize) -> Arc<ServerContext> {
    common::stories_context(
        cache_tokens,
        max_sessions,
        1 << 20,
        pb::ServerRecord::default(),
    )
}

fn open(ctx: &ServerContext, start: u32, end: u32, max_length: u32) -> pb::Request {
    common::open_request(&ctx.model_id, start, end, max_length)
}

fn step(session_id: u64, position: u32, hidden: pb::Tensor) -> pb::Request {
    pb::Request {
        kind: Some(request::Kind::Step(pb::Step {
            session_id,
            position,
            hidden: Some(hidden),
            ..Default::default()
        })),
    }
}

fn hidden(tokens: usize, value: f32) -> pb::Tensor {
    let t = Tensor::full(value, (1, tokens, HIDDEN), &Device::Cpu).unwrap();
    to_wire(&t, pb::WireDType::F32).unwrap()
}

#[tokio::test]
async fn every_bad_request_gets_its_typed_error_and_the_session_survives() {
    let ctx = context(1024, 8);
    let mut state = StreamState::new(PeerId::random());
    let id = opened(state.handle(open(&ctx, 0, 5, 16), &ctx).await);

    let mut bad_open = open(&ctx, 0, 5, 16);
    if let Some(request::Kind::Open(o)) = bad_open.kind.as_mut() {
        o.model_id = "another-model".into();
    }
    let mut bad_version = open(&ctx, 0, 5, 16);
    if let Some(request::Kind::Open(o)) = bad_version.kind.as_mut() {
        o.protocol_version = 99;
    }
    let nan = hidden(1, f32::NAN);
    let inf = hidden(1, f32::INFINITY);
    let mut short = hidden(1, 0.5);
    short.data.truncate(10);
    let wrong_size = to_wire(
        &Tensor::zeros((1, 1, HIDDEN - 1), DType::F32, &Device::Cpu).unwrap(),
        pb::WireDType::F32,
    )
    .unwrap();
    let wrong_dtype = to_wire(
        &Tensor::zeros((1, 1, HIDDEN), DType::F32, &Device::Cpu).unwrap(),
        pb::WireDType::F16,
    )
    .unwrap();
    let cases: Vec<(&str, pb::Request, ErrorCode)> = vec![
        (
            "unknown message type",
            pb::Request { kind: None },
            ErrorCode::BadRequest,
        ),
        ("wrong model", bad_open, ErrorCode::WrongModel),
        (
            "wrong protocol version",
            bad_version,
            ErrorCode::VersionMismatch,
        ),
        (
            "blocks not served",
            open(&ctx, 3, 7, 16),
            ErrorCode::BlocksNotServed,
        ),
        (
            "reversed blocks",
            open(&ctx, 4, 2, 16),
            ErrorCode::BlocksNotServed,
        ),
        ("max_length 0", open(&ctx, 0, 5, 0), ErrorCode::BadRequest),
        (
            "max_length past the model",
            open(&ctx, 0, 5, 100_000),
            ErrorCode::BadRequest,
        ),
        (
            "unknown session",
            step(id ^ 1, 0, hidden(1, 0.5)),
            ErrorCode::UnknownSession,
        ),
        (
            "wrong hidden size",
            step(id, 0, wrong_size),
            ErrorCode::ShapeMismatch,
        ),
        (
            "wrong dtype",
            step(id, 0, wrong_dtype),
            ErrorCode::DtypeMismatch,
        ),
        (
            "truncated tensor bytes",
            step(id, 0, short),
            ErrorCode::DtypeMismatch,
        ),
        ("NaN", step(id, 0, nan), ErrorCode::NonFinite),
        ("Inf", step(id, 0, inf), ErrorCode::NonFinite),
        (
            "position out of order",
            step(id, 3, hidden(1, 0.5)),
            ErrorCode::BadPosition,
        ),
        (
            "past max_length",
            step(id, 0, hidden(17, 0.5)),
            ErrorCode::BadPosition,
        ),
        (
            "step without hidden states",
            pb::Request {
                kind: Some(request::Kind::Step(pb::Step {
                    session_id: id,
                    position: 0,
                    hidden: None,
                    ..Default::default()
                })),
            },
            ErrorCode::BadRequest,
        ),
    ];
    for (what, req, expected) in cases {
        let reply = state.handle(req, &ctx).await;
        assert_eq!(code(&reply), Some(expected), "{what}: {reply:?}");
    }

    // The session is untouched: a valid step at position 0 gives what the span computes directly.
    let reply = state.handle(step(id, 0, hidden(2, 0.5)), &ctx).await;
    let out = match reply {
        response::Kind::Step(s) => s.hidden.unwrap(),
        other => panic!("{other:?}"),
    };
    let mut direct = ctx.span.new_cache(BlockRange::new(0, 5), 16).unwrap();
    let x = Tensor::full(0.5f32, (1, 2, HIDDEN), &Device::Cpu).unwrap();
    let expected = to_wire(
        &ctx.span.forward(&x, 0, &mut direct).unwrap(),
        pb::WireDType::F32,
    )
    .unwrap();
    assert_eq!(out.data, expected.data);
    assert_eq!(state.open_sessions(), 1);
}

#[tokio::test]
async fn another_streams_session_is_unknown() {
    let ctx = context(1024, 8);
    let mut owner = StreamState::new(PeerId::random());
    let mut intruder = StreamState::new(PeerId::random());
    let id = opened(owner.handle(open(&ctx, 0, 5, 8), &ctx).await);
    let reply = intruder.handle(step(id, 0, hidden(1, 0.5)), &ctx).await;
    assert_eq!(code(&reply), Some(ErrorCode::UnknownSession));
    let close = pb::Request {
        kind: Some(request::Kind::Close(pb::CloseSession { session_id: id })),
    };
    assert_eq!(
        code(&intruder.handle(close.clone(), &ctx).await),
        Some(ErrorCode::UnknownSession)
    );
    assert!(matches!(
        owner.handle(close, &ctx).await,
        response::Kind::Closed(_)
    ));
}

#[tokio::test]
async fn cache_budget_refuses_then_admits() {
    // Room for two sessions of 32 positions.
    let ctx = context(64, 8);
    let mut state = StreamState::new(PeerId::random());
    let a = opened(state.handle(open(&ctx, 0, 5, 32), &ctx).await);
    let _b = opened(state.handle(open(&ctx, 0, 5, 32), &ctx).await);
    let third = state.handle(open(&ctx, 0, 5, 32), &ctx).await;
    assert_eq!(code(&third), Some(ErrorCode::CacheFull), "{third:?}");
    let close = pb::Request {
        kind: Some(request::Kind::Close(pb::CloseSession { session_id: a })),
    };
    assert!(matches!(
        state.handle(close, &ctx).await,
        response::Kind::Closed(_)
    ));
    opened(state.handle(open(&ctx, 0, 5, 32), &ctx).await);
    // A stream that goes away frees everything it held.
    drop(state);
    assert_eq!(ctx.admission.usage().tokens_used, 0);
    assert_eq!(ctx.admission.usage().sessions, 0);
}

#[tokio::test]
async fn session_limit_is_busy() {
    let ctx = context(1024, 1);
    let mut state = StreamState::new(PeerId::random());
    opened(state.handle(open(&ctx, 0, 5, 8), &ctx).await);
    assert_eq!(
        code(&state.handle(open(&ctx, 0, 5, 8), &ctx).await),
        Some(ErrorCode::Busy)
    );
}

/// Resident memory in bytes (Linux).
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[tokio::test]
async fn bad_requests_do_not_grow_memory() {
    let ctx = context(1024, 8);
    let mut state = StreamState::new(PeerId::random());
    let id = opened(state.handle(open(&ctx, 0, 5, 16), &ctx).await);
    let bad = || step(id, 0, hidden(1, f32::NAN));
    for _ in 0..200 {
        state.handle(bad(), &ctx).await;
    }
    let before = rss();
    for _ in 0..5000 {
        let reply = state.handle(bad(), &ctx).await;
        assert_eq!(code(&reply), Some(ErrorCode::NonFinite));
        state.handle(open(&ctx, 9, 10, 16), &ctx).await;
    }
    let growth = rss().saturating_sub(before);
    assert!(
        growth < 16 << 20,
        "RSS grew by {growth} bytes over 10000 bad requests"
    );
    assert_eq!(ctx.admission.usage().sessions, 1);
}

mod fuzz {
    //! The session state machine under random request sequences: no panic, every request answered, the cache
    //! budget never exceeded, and everything freed when the stream goes.
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Open {
            start: u32,
            end: u32,
            max_length: u32,
            right_model: bool,
        },
        Step {
            session: usize,
            position: u32,
            tokens: usize,
            value: f32,
            dtype: i32,
            width: usize,
        },
        Close {
            session: usize,
        },
        Info,
        Empty,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..7, 0u32..7, 0u32..40, any::<bool>()).prop_map(
                |(start, end, max_length, right_model)| Op::Open {
                    start,
                    end,
                    max_length,
                    right_model
                }
            ),
            (
                0usize..4,
                0u32..20,
                1usize..5,
                prop_oneof![Just(0.25f32), Just(f32::NAN), Just(-1e3)],
                0i32..5,
                prop_oneof![Just(64usize), Just(63), Just(1)]
            )
                .prop_map(|(session, position, tokens, value, dtype, width)| {
                    Op::Step {
                        session,
                        position,
                        tokens,
                        value,
                        dtype,
                        width,
                    }
                }),
            (0usize..4).prop_map(|session| Op::Close { session }),
            Just(Op::Info),
            Just(Op::Empty),
        ]
    }

    fn request(op: &Op, ctx: &ServerContext, ids: &[u64]) -> pb::Request {
        let id = |i: usize| ids.get(i).copied().unwrap_or(i as u64 + 12345);
        match op {
            Op::Open {
                start,
                end,
                max_length,
                right_model,
            } => {
                let mut r = open(ctx, *start, *end, *max_length);
                if let (false, Some(request::Kind::Open(o))) = (*right_model, r.kind.as_mut()) {
                    o.model_id = "other".into();
                }
                r
            }
            Op::Step {
                session,
                position,
                tokens,
                value,
                dtype,
                width,
            } => {
                let values = vec![*value; tokens * width];
                let t = petal_proto::tensor::from_f32(
                    &values,
                    &[1, *tokens, *width],
                    pb::WireDType::F32,
                );
                let t = pb::Tensor { dtype: *dtype, ..t };
                step(id(*session), *position, t)
            }
            Op::Close { session } => pb::Request {
                kind: Some(request::Kind::Close(pb::CloseSession {
                    session_id: id(*session),
                })),
            },
            Op::Info => pb::Request {
                kind: Some(request::Kind::Info(pb::InfoRequest {})),
            },
            Op::Empty => pb::Request { kind: None },
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        #[test]
        fn random_sequences_never_break_the_server(ops in proptest::collection::vec(op(), 1..40)) {
            let ctx = context(64, 3);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let mut state = StreamState::new(PeerId::random());
                let mut ids = vec![];
                for op in &ops {
                    let reply = state.handle(request(op, &ctx, &ids), &ctx).await;
                    if let response::Kind::Opened(o) = &reply {
                        ids.push(o.session_id);
                    }
                    let usage = ctx.admission.usage();
                    prop_assert!(usage.tokens_used <= usage.tokens_total);
                    prop_assert!(usage.sessions <= 3);
                }
                drop(state);
                prop_assert_eq!(ctx.admission.usage().sessions, 0);
                prop_assert_eq!(ctx.admission.usage().tokens_used, 0);
                Ok(())
            })?;
        }
    }
}

/// Server-to-server push through the state machine: a push with the session's token feeds its awaiting step (whose
/// answer carries the input it got), a forged token is refused, and a step whose push never comes times out with
/// the session unchanged.
#[tokio::test]
async fn pushes_need_the_sessions_token_and_a_missing_push_changes_nothing() {
    let ctx = context(1024, 8);
    let mut client = StreamState::new(PeerId::random());
    let response::Kind::Opened(o) = client.handle(open(&ctx, 0, 5, 16), &ctx).await else {
        panic!("session not opened");
    };
    let (id, token) = (o.session_id, o.push_token);
    assert_eq!(token.len(), 16, "a push token comes with every session");
    let push = |token: Vec<u8>, position: u32| pb::Request {
        kind: Some(request::Kind::Push(pb::Push {
            session_id: id,
            push_token: token,
            position,
            hidden: Some(hidden(1, 0.5)),
            ..Default::default()
        })),
    };
    let awaited = |position: u32, wait_ms: u32| pb::Request {
        kind: Some(request::Kind::Step(pb::Step {
            session_id: id,
            position,
            await_push: true,
            push_wait_ms: wait_ms,
            ..Default::default()
        })),
    };
    // Another peer (the previous server) pushes on its own stream.
    let mut previous = StreamState::new(PeerId::random());
    let forged = previous.handle(push(vec![0; 16], 0), &ctx).await;
    assert_eq!(code(&forged), Some(ErrorCode::UnknownSession));
    // Nothing pushed: PUSH_TIMEOUT, and the session still takes position 0.
    let reply = client.handle(awaited(0, 50), &ctx).await;
    assert_eq!(code(&reply), Some(ErrorCode::PushTimeout));
    let pushed = previous.handle(push(token.clone(), 0), &ctx).await;
    assert!(matches!(pushed, response::Kind::Pushed(_)), "{pushed:?}");
    match client.handle(awaited(0, 5000), &ctx).await {
        response::Kind::Step(r) => {
            assert_eq!(r.input.map(|t| t.data), Some(hidden(1, 0.5).data));
            assert!(r.hidden.is_some());
        }
        other => panic!("pushed step failed: {other:?}"),
    }
    // The session moved on: position 1 is next, and a closed session takes no more pushes.
    let reply = client.handle(step(id, 1, hidden(1, 0.25)), &ctx).await;
    assert!(matches!(reply, response::Kind::Step(_)), "{reply:?}");
    let close = pb::Request {
        kind: Some(request::Kind::Close(pb::CloseSession { session_id: id })),
    };
    client.handle(close, &ctx).await;
    let late = previous.handle(push(token, 2), &ctx).await;
    assert_eq!(code(&late), Some(ErrorCode::UnknownSession));
}

/// A refused push that asks for no answer costs its sender nothing to repeat: past the peer's budget of cheap
/// requests its stream is reset, and the node serves other peers on (real swarms on loopback, `serve_stream`).
#[tokio::test]
async fn a_flood_of_refused_unanswered_pushes_resets_its_stream_and_the_node_serves_on() {
    use common::loopback_network;
    use futures::StreamExt;
    use petal_node::handler::serve_stream;
    use petal_p2p::Network;
    use petal_proto::FramedStream;
    use std::time::Duration;
    let ctx = context(1024, 8);
    let (server, flooder, other) = (
        loopback_network().await,
        loopback_network().await,
        loopback_network().await,
    );
    let mut incoming = server.accept_streams().expect("accepting");
    let serving = ctx.clone();
    tokio::spawn(async move {
        while let Some((peer, stream)) = incoming.next().await {
            tokio::spawn(serve_stream(stream, peer, serving.clone()));
        }
    });
    let addrs = server.listen_addrs().await;
    let open = |net: Network| {
        let addrs = addrs.clone();
        let to = server.peer_id();
        async move {
            net.add_addresses(to, addrs).await;
            FramedStream::new(net.open_stream(to).await.expect("stream opens"), 1 << 20)
        }
    };
    let mut flood = open(flooder.clone()).await;
    let bogus = pb::Request {
        kind: Some(request::Kind::Push(pb::Push {
            session_id: 1,
            push_token: vec![0; 16],
            position: 0,
            hidden: Some(hidden(1, 0.5)),
            unanswered: true,
        })),
    };
    // Well past the default burst of 100 cheap requests; once the stream is reset, sending fails.
    for _ in 0..400 {
        if flood.send(&bogus).await.is_err() {
            break;
        }
    }
    let ended = tokio::time::timeout(Duration::from_secs(20), flood.recv::<pb::Response>())
        .await
        .expect("the flooding stream is ended by the node");
    assert!(
        !matches!(ended, Ok(Some(_))),
        "a refused unanswered push was answered: {ended:?}"
    );
    let mut asking = open(other.clone()).await;
    asking
        .send(&pb::Request {
            kind: Some(request::Kind::Info(pb::InfoRequest {})),
        })
        .await
        .expect("info sent");
    let info = asking.recv::<pb::Response>().await.expect("answer");
    assert!(
        matches!(
            info,
            Some(pb::Response {
                kind: Some(response::Kind::Info(_))
            })
        ),
        "{info:?}"
    );
    for net in [flooder, other, server] {
        net.shutdown().await;
    }
}

//! Growing reservations and sharing the cache between peers, through the request state machine: a session grows
//! when the budget allows (and computes as if it had been opened that long), a peer over its fair share loses its
//! idle sessions to a peer below it, the loser is told `EVICTED`, and the metrics show refusals by reason and what
//! each peer holds.
mod common;

use common::{code, opened, sample};

use candle_core::{Device, Tensor};
use petal_model::compute::wire::{from_wire, to_wire};
use petal_node::admission::AdmissionLimits;
use petal_node::handler::{Reply, StreamState};
use petal_node::limits::ServeLimits;
use petal_node::{metrics, ServerContext};
use petal_p2p::PeerId;
use petal_proto::pb::{self, request, response, ErrorCode};
use std::sync::Arc;
use std::time::Duration;

const HIDDEN: usize = 64;

fn context(
    cache_tokens: usize,
    max_sessions_per_peer: usize,
    reclaim_idle: Duration,
) -> Arc<ServerContext> {
    common::stories_context_with(
        AdmissionLimits {
            cache_tokens,
            position_bytes: 4096,
            max_sessions: 8,
            max_sessions_per_peer,
            reclaim_idle,
        },
        ServeLimits::default(),
        pb::ServerRecord::default(),
    )
}

fn open(ctx: &ServerContext, max_length: u32) -> pb::Request {
    common::open_request(&ctx.model_id, 0, 5, max_length)
}

fn extend(session_id: u64, max_length: u32) -> pb::Request {
    pb::Request {
        kind: Some(request::Kind::Extend(pb::ExtendSession {
            session_id,
            max_length,
        })),
    }
}

/// A step of `tokens` positions whose hidden states depend on the position (so that a wrong cache shows).
fn step(session_id: u64, position: u32, tokens: usize) -> pb::Request {
    let values: Vec<f32> = (0..tokens * HIDDEN)
        .map(|i| ((position as usize * HIDDEN + i) as f32 * 0.37).sin())
        .collect();
    let t = Tensor::from_vec(values, (1, tokens, HIDDEN), &Device::Cpu).unwrap();
    pb::Request {
        kind: Some(request::Kind::Step(pb::Step {
            session_id,
            position,
            hidden: Some(to_wire(&t, pb::WireDType::F32).unwrap()),
            ..Default::default()
        })),
    }
}

/// The step's output hidden states.
fn stepped(reply: Reply) -> Vec<f32> {
    match reply {
        response::Kind::Step(s) => {
            let hidden = s.hidden.expect("a step result carries hidden states");
            let shape: Vec<usize> = hidden.shape.iter().map(|d| *d as usize).collect();
            from_wire(&hidden, pb::WireDType::F32, &shape)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        }
        other => panic!("expected StepResult, got {other:?}"),
    }
}

#[tokio::test]
async fn a_session_grows_when_the_budget_allows_and_computes_as_if_opened_that_long() {
    let ctx = context(64, 8, Duration::from_secs(30));
    let mut state = StreamState::new(PeerId::random());
    let grown = opened(state.handle(open(&ctx, 16), &ctx).await);
    stepped(state.handle(step(grown, 0, 16), &ctx).await);
    assert_eq!(
        code(&state.handle(step(grown, 16, 1), &ctx).await),
        Some(ErrorCode::BadPosition),
        "a full session takes no more positions"
    );

    match state.handle(extend(grown, 32), &ctx).await {
        response::Kind::Extended(e) => assert_eq!((e.session_id, e.max_length), (grown, 32)),
        other => panic!("expected SessionExtended, got {other:?}"),
    }
    assert_eq!(ctx.admission.usage().tokens_used, 32);
    let after_growth = stepped(state.handle(step(grown, 16, 2), &ctx).await);

    // The same inputs through a session opened at 32 from the start: the same outputs, bit for bit.
    let mut other = StreamState::new(PeerId::random());
    let whole = opened(other.handle(open(&ctx, 32), &ctx).await);
    stepped(other.handle(step(whole, 0, 16), &ctx).await);
    assert_eq!(
        stepped(other.handle(step(whole, 16, 2), &ctx).await),
        after_growth
    );
    drop(other);

    // Beyond the budget: refused, and the session keeps its size and its cache.
    let refused = state.handle(extend(grown, 96), &ctx).await;
    assert_eq!(code(&refused), Some(ErrorCode::CacheFull), "{refused:?}");
    assert_eq!(ctx.admission.usage().tokens_used, 32);
    stepped(state.handle(step(grown, 18, 1), &ctx).await);

    // Shrinking, past the model's context, or an unknown session: typed errors.
    assert_eq!(
        code(&state.handle(extend(grown, 8), &ctx).await),
        Some(ErrorCode::BadRequest)
    );
    assert_eq!(
        code(&state.handle(extend(grown, 1 << 20), &ctx).await),
        Some(ErrorCode::BadRequest)
    );
    assert_eq!(
        code(&state.handle(extend(grown ^ 1, 40), &ctx).await),
        Some(ErrorCode::UnknownSession)
    );
    stepped(state.handle(step(grown, 19, 1), &ctx).await);
    drop(state);
    assert_eq!(ctx.admission.usage().tokens_used, 0);
}

#[tokio::test]
async fn a_batch_larger_than_the_session_was_opened_for_is_refused() {
    let ctx = context(64, 8, Duration::from_secs(30));
    let mut state = StreamState::new(PeerId::random());
    let id = opened(state.handle(open(&ctx, 8), &ctx).await);
    let batch_of_two =
        Tensor::zeros((2, 1, HIDDEN), candle_core::DType::F32, &Device::Cpu).unwrap();
    let reply = state
        .handle(
            pb::Request {
                kind: Some(request::Kind::Step(pb::Step {
                    session_id: id,
                    position: 0,
                    hidden: Some(to_wire(&batch_of_two, pb::WireDType::F32).unwrap()),
                    ..Default::default()
                })),
            },
            &ctx,
        )
        .await;
    assert_eq!(code(&reply), Some(ErrorCode::ShapeMismatch), "{reply:?}");
    stepped(state.handle(step(id, 0, 1), &ctx).await);
}

#[tokio::test]
async fn a_peer_over_its_share_loses_its_idle_session_to_a_peer_below_it() {
    // Room for two sessions of 32; sessions count as idle at once, so only fair shares decide.
    let ctx = context(64, 8, Duration::ZERO);
    let (squatter, newcomer) = (PeerId::random(), PeerId::random());
    let mut a = StreamState::new(squatter);
    let old = opened(a.handle(open(&ctx, 32), &ctx).await);
    let recent = opened(a.handle(open(&ctx, 32), &ctx).await);
    stepped(a.handle(step(recent, 0, 1), &ctx).await);

    // The newcomer's share is half the cache: it gets a session, taken from the squatter's least recently used.
    let mut b = StreamState::new(newcomer);
    let fresh = opened(b.handle(open(&ctx, 32), &ctx).await);
    assert_eq!(ctx.admission.evictions(), 1);
    assert_eq!(ctx.admission.usage().tokens_used, 64);
    // Beyond its own share, only free room would do: refused, nothing evicted.
    let refused = b.handle(open(&ctx, 32), &ctx).await;
    assert_eq!(code(&refused), Some(ErrorCode::CacheFull), "{refused:?}");
    assert_eq!(ctx.admission.evictions(), 1);

    // The squatter is told why its session is gone; its other one works on.
    let gone = a.handle(step(old, 0, 1), &ctx).await;
    assert_eq!(code(&gone), Some(ErrorCode::Evicted), "{gone:?}");
    stepped(a.handle(step(recent, 1, 1), &ctx).await);
    stepped(b.handle(step(fresh, 0, 1), &ctx).await);

    let page = metrics::render(&*ctx);
    assert_eq!(sample(&page, "petal_sessions_evicted_total"), 1.0, "{page}");
    assert_eq!(
        sample(&page, "petal_refusals_total{reason=\"cache_full\"}"),
        1.0,
        "{page}"
    );
    for (peer, sessions, tokens) in [(squatter, 1.0, 32.0), (newcomer, 1.0, 32.0)] {
        assert_eq!(
            sample(&page, &format!("petal_peer_sessions{{peer=\"{peer}\"}}")),
            sessions,
            "{page}"
        );
        assert_eq!(
            sample(
                &page,
                &format!("petal_peer_cache_tokens{{peer=\"{peer}\"}}")
            ),
            tokens,
            "{page}"
        );
    }

    // A peer that leaves disappears from the per-peer series.
    drop(a);
    let page = metrics::render(&*ctx);
    assert!(!page.contains(&squatter.to_string()), "{page}");
}

#[tokio::test]
async fn a_peer_at_its_session_cap_is_refused_while_others_are_admitted() {
    let ctx = context(1024, 2, Duration::from_secs(30));
    let peer = PeerId::random();
    let mut a = StreamState::new(peer);
    opened(a.handle(open(&ctx, 8), &ctx).await);
    opened(a.handle(open(&ctx, 8), &ctx).await);
    // Another stream of the same peer counts against the same cap.
    let mut a_again = StreamState::new(peer);
    let refused = a_again.handle(open(&ctx, 8), &ctx).await;
    assert_eq!(code(&refused), Some(ErrorCode::Busy), "{refused:?}");
    let mut b = StreamState::new(PeerId::random());
    opened(b.handle(open(&ctx, 8), &ctx).await);
    let page = metrics::render(&*ctx);
    assert_eq!(
        sample(&page, "petal_refusals_total{reason=\"peer_busy\"}"),
        1.0,
        "{page}"
    );
}

//! What the node's tests share: a server context over stories260K, built without a network, and requests.
#![allow(dead_code)]
use petal_model::{models_dir, BlockRange, ModelSource, Placement};
use petal_node::admission::{Admission, AdmissionLimits};
use petal_node::handler::Reply;
use petal_node::limits::ServeLimits;
use petal_node::ServerContext;
use petal_proto::pb::{self, request, response, ErrorCode};
use petal_proto::PROTOCOL_VERSION;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// stories260K in llama2.c format: 5 blocks, hidden size 64.
pub fn stories() -> PathBuf {
    let relative = "stories260K/stories260K.bin";
    models_dir::find_model(relative)
        .unwrap_or_else(|| panic!("{}", models_dir::missing_model(relative)))
}

/// A server context over all 5 blocks of stories260K with these limits and announced record.
pub fn stories_context(
    cache_tokens: usize,
    max_sessions: usize,
    max_frame_bytes: usize,
    record: pb::ServerRecord,
) -> Arc<ServerContext> {
    stories_context_with(
        AdmissionLimits {
            cache_tokens,
            position_bytes: 4096,
            max_sessions,
            max_sessions_per_peer: max_sessions,
            reclaim_idle: Duration::from_secs(30),
        },
        ServeLimits {
            session_timeout: Duration::from_secs(60),
            max_frame_bytes,
            peer_buffer_bytes: max_frame_bytes.max(ServeLimits::default().peer_buffer_bytes),
            ..ServeLimits::default()
        },
        record,
    )
}

/// A server context over all 5 blocks of stories260K with these admission and serving limits.
pub fn stories_context_with(
    admission: AdmissionLimits,
    limits: ServeLimits,
    record: pb::ServerRecord,
) -> Arc<ServerContext> {
    let source = ModelSource::open(stories()).unwrap();
    let span = source
        .load_span_on(BlockRange::new(0, 5), &Placement::cpu_f32())
        .unwrap();
    Arc::new(
        ServerContext::new(
            Arc::new(span),
            source.model_id().unwrap(),
            Admission::new(admission),
            limits,
            record,
        )
        .unwrap(),
    )
}

/// A network of its own listening on loopback TCP, as a test's peer (no bootstrap, no DHT serving).
pub async fn loopback_network() -> petal_p2p::Network {
    let mut config = petal_p2p::NetConfig::new(petal_p2p::Keypair::generate_ed25519());
    config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("multiaddr")];
    petal_p2p::Network::start(config)
        .await
        .expect("network starts")
}

/// An OpenSession request for blocks `start..end` of `model_id`.
pub fn open_request(model_id: &str, start: u32, end: u32, max_length: u32) -> pb::Request {
    pb::Request {
        kind: Some(request::Kind::Open(pb::OpenSession {
            protocol_version: PROTOCOL_VERSION,
            model_id: model_id.to_string(),
            start_block: start,
            end_block: end,
            max_length,
            max_batch: 1,
        })),
    }
}

/// The error code of a reply, `None` for any other answer.
pub fn code(reply: &Reply) -> Option<ErrorCode> {
    match reply {
        response::Kind::Error(e) => ErrorCode::try_from(e.code).ok(),
        _ => None,
    }
}

/// The session id of a `SessionOpened` reply; panics on anything else.
pub fn opened(reply: Reply) -> u64 {
    match reply {
        response::Kind::Opened(o) => o.session_id,
        other => panic!("expected SessionOpened, got {other:?}"),
    }
}

/// The value of the sample named exactly `series` (labels included) on a metrics page; panics when absent.
pub fn sample(page: &str, series: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse::<f64>().ok())?
        })
        .unwrap_or_else(|| panic!("no sample {series} in\n{page}"))
}

//! The Prometheus endpoint: steps driven through the request state machine show up in `GET /metrics` (counters,
//! latency and batch size histograms, session and cache gauges, build info), and `Node::start` serves it on
//! `--metrics-listen`.
mod common;

use common::{opened, sample};

use candle_core::{Device, Tensor};
use petal_model::compute::wire::to_wire;
use petal_model::BlockRange;
use petal_node::handler::{Reply, StreamState};
use petal_node::{metrics, Node, NodeConfig, ServerContext};
use petal_p2p::PeerId;
use petal_proto::pb::{self, request, response};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HIDDEN: usize = 64;
const CACHE_TOKENS: usize = 1024;

/// A server context over all 5 blocks of stories260K, built without a network.
fn context() -> Arc<ServerContext> {
    let record = pb::ServerRecord {
        model_name: "stories260K".into(),
        ..Default::default()
    };
    common::stories_context(CACHE_TOKENS, 8, 1 << 20, record)
}

fn open(ctx: &ServerContext, max_length: u32) -> pb::Request {
    common::open_request(&ctx.model_id, 0, 5, max_length)
}

fn step(session_id: u64, position: u32, tokens: usize) -> pb::Request {
    let t = Tensor::full(0.25f32, (1, tokens, HIDDEN), &Device::Cpu).unwrap();
    pb::Request {
        kind: Some(request::Kind::Step(pb::Step {
            session_id,
            position,
            hidden: Some(to_wire(&t, pb::WireDType::F32).unwrap()),
            ..Default::default()
        })),
    }
}

fn close(session_id: u64) -> pb::Request {
    pb::Request {
        kind: Some(request::Kind::Close(pb::CloseSession { session_id })),
    }
}

fn stepped(reply: Reply) {
    assert!(
        matches!(reply, response::Kind::Step(_)),
        "expected StepResult, got {reply:?}"
    );
}

/// A minimal HTTP/1.1 GET: (status, content type, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let mut stream = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .expect("connect timed out")
    .expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("response timed out")
        .unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("no header end");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let content_type = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    (status, content_type, body.to_string())
}

#[tokio::test]
async fn steps_show_up_in_the_scraped_metrics() {
    let ctx = context();
    let listener = metrics::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(metrics::serve(listener, ctx.clone()));

    // Before any session: zero everywhere, the whole budget free.
    let (status, content_type, page) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(content_type, metrics::CONTENT_TYPE);
    assert!(
        page.ends_with("# EOF\n"),
        "not a complete exposition:\n{page}"
    );
    assert_eq!(sample(&page, "petal_steps_total"), 0.0);
    assert_eq!(sample(&page, "petal_sessions_open"), 0.0);
    assert_eq!(
        sample(&page, "petal_kv_cache_tokens_free"),
        CACHE_TOKENS as f64
    );

    // One session of 16 positions; a 3-token prefill and a 1-token decode step.
    let mut state = StreamState::new(PeerId::random());
    let id = opened(state.handle(open(&ctx, 16), &ctx).await);
    stepped(state.handle(step(id, 0, 3), &ctx).await);
    stepped(state.handle(step(id, 3, 1), &ctx).await);
    // A refused step (wrong position) is not counted.
    let refused = state.handle(step(id, 0, 1), &ctx).await;
    assert!(matches!(refused, response::Kind::Error(_)));

    let (_, _, page) = get(addr, "/metrics").await;
    assert_eq!(sample(&page, "petal_steps_total"), 2.0);
    assert_eq!(sample(&page, "petal_tokens_processed_total"), 4.0);
    assert_eq!(sample(&page, "petal_step_duration_seconds_count"), 2.0);
    let sum = sample(&page, "petal_step_duration_seconds_sum");
    assert!(sum > 0.0 && sum < 10.0, "step time sum {sum}");
    assert_eq!(
        sample(&page, "petal_step_duration_seconds_bucket{le=\"+Inf\"}"),
        2.0
    );
    assert_eq!(
        sample(&page, "petal_step_duration_seconds_bucket{le=\"10.0\"}"),
        2.0
    );
    assert!(
        page.contains("petal_step_duration_seconds_bucket{le=\"0.0001\"}"),
        "100 µs bucket missing:\n{page}"
    );
    assert_eq!(sample(&page, "petal_sessions_open"), 1.0);
    assert_eq!(sample(&page, "petal_kv_cache_tokens_used"), 16.0);
    assert_eq!(
        sample(&page, "petal_kv_cache_tokens_free"),
        (CACHE_TOKENS - 16) as f64
    );
    assert_eq!(
        sample(&page, "petal_kv_cache_tokens_total"),
        CACHE_TOKENS as f64
    );
    let build = format!(
        "petal_build_info{{version=\"{}\",model=\"stories260K\",model_id=\"{}\",blocks=\"0..5\"}}",
        env!("CARGO_PKG_VERSION"),
        ctx.model_id
    );
    assert_eq!(sample(&page, &build), 1.0);
    assert!(page.contains("# TYPE petal_steps counter"));
    assert!(page.contains("# TYPE petal_step_duration_seconds histogram"));
    // One session stepping alone: two batches of one step each (the batch is counted before its steps answer).
    assert_eq!(sample(&page, "petal_batch_sessions_count"), 2.0);
    assert_eq!(sample(&page, "petal_batch_sessions_sum"), 2.0);
    assert_eq!(
        sample(&page, "petal_batch_sessions_bucket{le=\"1.0\"}"),
        2.0
    );
    assert!(page.contains("# TYPE petal_batch_sessions histogram"));
    assert!(page.contains("# UNIT petal_step_duration_seconds seconds"));

    // Closing gives the reservation back; counters keep their totals.
    assert!(matches!(
        state.handle(close(id), &ctx).await,
        response::Kind::Closed(_)
    ));
    let (_, _, page) = get(addr, "/metrics").await;
    assert_eq!(sample(&page, "petal_sessions_open"), 0.0);
    assert_eq!(sample(&page, "petal_kv_cache_tokens_used"), 0.0);
    assert_eq!(sample(&page, "petal_steps_total"), 2.0);

    // Only /metrics is served.
    let (status, _, _) = get(addr, "/").await;
    assert_eq!(status, 404);
    server.abort();
}

#[tokio::test]
async fn a_started_node_serves_metrics_on_its_metrics_listen_address() {
    let mut config = NodeConfig::new(common::stories(), BlockRange::new(1, 4));
    config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    config.cache_tokens = 512;
    let node = Node::start(config).await.unwrap();
    let addr = node.metrics_addr().expect("metrics address");
    assert_ne!(addr.port(), 0, "the real port is reported");
    let (status, _, page) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(sample(&page, "petal_kv_cache_tokens_total"), 512.0);
    assert_eq!(sample(&page, "petal_sessions_open"), 0.0);
    assert!(
        page.contains(&format!("model_id=\"{}\"", node.model_id())),
        "{page}"
    );
    assert!(page.contains("blocks=\"1..4\""), "{page}");
    node.shutdown(Duration::from_millis(100)).await;
    // The metrics server stops with the node.
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        refused.is_ok(),
        "metrics port still accepting after shutdown"
    );
}

#[tokio::test]
async fn a_taken_metrics_port_fails_at_start_naming_the_flag() {
    let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = NodeConfig::new(common::stories(), BlockRange::new(0, 5));
    config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    config.metrics_listen = Some(taken.local_addr().unwrap());
    let err = Node::start(config).await.err().expect("start must fail");
    assert!(
        format!("{err:#}").contains("--metrics-listen"),
        "error does not name the flag: {err:#}"
    );
}

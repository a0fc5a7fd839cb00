//! Per-hop costs of one decode step, measured apart from the model: serialisation, a loopback libp2p round trip of
//! the same frames, and the hand-off to tokio's blocking pool. They say what bounds the latency a hop adds; no
//! library code does this (these are measurements of the transport, not a client of the protocol).
use crate::report::{median_ms, round};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use futures::StreamExt;
use petal_model::compute::wire::{from_wire, to_wire, wire_dtype};
use petal_p2p::{Keypair, NetConfig, Network};
use petal_proto::frame::{decode_frame, encode_frame};
use petal_proto::pb::{self, request, response};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Round trips timed after an idle gap, and the gap: about one decode step of a small model, long enough for
/// tokio's and the kernel's threads to park, as they do while a node computes.
const IDLE_ITERS: usize = 50;
const IDLE_GAP: Duration = Duration::from_millis(20);
/// Iterations of the microbenchmarks (each is microseconds, so this costs well under a second).
const OVERHEAD_ITERS: usize = 400;

/// Per-hop costs of one decode step, measured apart from the model.
pub async fn measure(hidden_size: usize, dtype: DType) -> Result<Value> {
    eprintln!("overhead   serialisation, loopback round trip, blocking-pool hand-off");
    let wire = measure_serialisation(hidden_size, dtype)?;
    let (transport, transport_idle) = measure_round_trip(&wire.request).await?;
    let (handoff, handoff_idle) = measure_spawn_blocking().await?;
    let serialise_us = wire.client_encode_us
        + wire.server_decode_us
        + wire.server_encode_us
        + wire.client_decode_us;
    Ok(json!({
        "wire_dtype": dtype.as_str(),
        "hidden_bytes_per_token": hidden_size * dtype.size_in_bytes(),
        "request_frame_bytes": wire.request_frame_bytes,
        "response_frame_bytes": wire.response_frame_bytes,
        "serialise_us_per_hop": {
            "client_encode": round(wire.client_encode_us, 2),
            "server_decode": round(wire.server_decode_us, 2),
            "server_encode": round(wire.server_encode_us, 2),
            "client_decode": round(wire.client_decode_us, 2),
            "total": round(serialise_us, 2),
        },
        "loopback_round_trip_us": round(transport, 1),
        "loopback_round_trip_after_idle_us": round(transport_idle, 1),
        "spawn_blocking_us": round(handoff, 1),
        "spawn_blocking_after_idle_us": round(handoff_idle, 1),
        "idle_gap_ms": IDLE_GAP.as_secs_f64() * 1e3,
        "predicted_ms_per_hop": round((serialise_us + transport + handoff) / 1e3, 3),
        "predicted_ms_per_hop_after_idle": round((serialise_us + transport_idle + handoff_idle) / 1e3, 3),
    }))
}

/// What one decode step costs to serialise at each end of one hop (medians, microseconds).
struct WireCost {
    request: pb::Request,
    request_frame_bytes: usize,
    response_frame_bytes: usize,
    client_encode_us: f64,
    server_decode_us: f64,
    server_encode_us: f64,
    client_decode_us: f64,
}

/// Times the four conversions one hop of one decode step goes through, exactly as the client's session and the
/// node's handler do them: tensor to wire bytes and frame, frame to checked tensor, and back.
fn measure_serialisation(hidden_size: usize, dtype: DType) -> Result<WireCost> {
    let wd = wire_dtype(dtype)?;
    let hidden = Tensor::randn(0f32, 1.0, (1, 1, hidden_size), &Device::Cpu)?.to_dtype(dtype)?;
    let max = DEFAULT_MAX_FRAME_BYTES;
    let mut phases: [Vec<Duration>; 4] = Default::default();
    let (mut request, mut request_bytes, mut response_bytes) = (None, 0, 0);
    for _ in 0..OVERHEAD_ITERS {
        let t0 = Instant::now();
        let w = to_wire(&hidden, wd)?;
        let req = pb::Request {
            kind: Some(request::Kind::Step(pb::Step {
                session_id: 1,
                position: 0,
                // The session keeps a copy of every input for replay; clone as it does.
                hidden: Some(w.clone()),
                ..Default::default()
            })),
        };
        let frame = encode_frame(&req);
        let t1 = Instant::now();
        let (got, _) = decode_frame::<pb::Request>(&frame, max)?;
        let x = checked_hidden(step_hidden(got)?, hidden_size)?;
        let t2 = Instant::now();
        let resp = pb::Response {
            kind: Some(response::Kind::Step(pb::StepResult {
                session_id: 1,
                position: 0,
                hidden: Some(to_wire(&x, wd)?),
                compute_micros: 0,
                input: None,
            })),
        };
        let back = encode_frame(&resp);
        let t3 = Instant::now();
        let (got, _) = decode_frame::<pb::Response>(&back, max)?;
        let out = match got.kind {
            Some(response::Kind::Step(s)) => s.hidden,
            _ => None,
        };
        checked_hidden(out.context("no hidden states")?, hidden_size)?;
        let t4 = Instant::now();
        for (p, d) in phases.iter_mut().zip([t1 - t0, t2 - t1, t3 - t2, t4 - t3]) {
            p.push(d);
        }
        (request_bytes, response_bytes) = (frame.len(), back.len());
        request = Some(req);
    }
    let us = |d: &[Duration]| median_ms(d) * 1e3;
    Ok(WireCost {
        request: request.context("no iteration ran")?,
        request_frame_bytes: request_bytes,
        response_frame_bytes: response_bytes,
        client_encode_us: us(&phases[0]),
        server_decode_us: us(&phases[1]),
        server_encode_us: us(&phases[2]),
        client_decode_us: us(&phases[3]),
    })
}

fn step_hidden(req: pb::Request) -> Result<pb::Tensor> {
    match req.kind {
        Some(request::Kind::Step(s)) => s.hidden.context("step without hidden states"),
        _ => bail!("not a step"),
    }
}

/// The receiving end's checks and conversion: shape and size, finiteness, then a CPU tensor.
fn checked_hidden(t: pb::Tensor, hidden_size: usize) -> Result<Tensor> {
    let (dtype, shape) = petal_proto::tensor::validate(&t, hidden_size)?;
    petal_proto::tensor::check_finite(dtype, &t.data)?;
    Ok(from_wire(&t, dtype, &shape)?)
}

/// Median round trips of one decode step's frames over a libp2p stream between two in-process peers on loopback
/// (TCP, noise, yamux, as between a client and a node), with a server that echoes the hidden states back: back to
/// back (threads hot), and after an idle gap as long as a decode step (threads parked, as during a node's compute).
async fn measure_round_trip(request: &pb::Request) -> Result<(f64, f64)> {
    let mut server_config = NetConfig::new(Keypair::generate_ed25519());
    server_config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
    let server = Network::start(server_config).await?;
    let mut incoming = server.accept_streams()?;
    let echo = tokio::spawn(async move {
        while let Some((_, stream)) = incoming.next().await {
            tokio::spawn(echo_steps(stream));
        }
    });
    let client = Network::start(NetConfig::new(Keypair::generate_ed25519())).await?;
    client
        .add_addresses(server.peer_id(), server.listen_addrs().await)
        .await;
    let stream = client.open_stream(server.peer_id()).await?;
    let mut framed = FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES);
    // The first round trips warm up the connection and the yamux windows.
    for _ in 0..20 {
        round_trip(&mut framed, request).await?;
    }
    let mut hot = vec![];
    for _ in 0..OVERHEAD_ITERS {
        hot.push(round_trip(&mut framed, request).await?);
    }
    let mut idle = vec![];
    for _ in 0..IDLE_ITERS {
        tokio::time::sleep(IDLE_GAP).await;
        idle.push(round_trip(&mut framed, request).await?);
    }
    framed.close().await;
    client.shutdown().await;
    server.shutdown().await;
    echo.abort();
    Ok((median_ms(&hot) * 1e3, median_ms(&idle) * 1e3))
}

async fn round_trip(
    framed: &mut FramedStream<petal_p2p::Stream>,
    request: &pb::Request,
) -> Result<Duration> {
    let t = Instant::now();
    framed.send(request).await?;
    framed
        .recv::<pb::Response>()
        .await?
        .context("echo stream closed")?;
    Ok(t.elapsed())
}

/// Answers every step with its own hidden states, as a node with no blocks would.
async fn echo_steps(stream: petal_p2p::Stream) {
    let mut framed = FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES);
    while let Ok(Some(req)) = framed.recv::<pb::Request>().await {
        let hidden = step_hidden(req).ok();
        let reply = pb::Response {
            kind: Some(response::Kind::Step(pb::StepResult {
                session_id: 1,
                position: 0,
                hidden,
                compute_micros: 0,
                input: None,
            })),
        };
        if framed.send(&reply).await.is_err() {
            break;
        }
    }
}

/// Median times to hand an empty job to tokio's blocking pool and get its result back, as the node does for every
/// step's compute: back to back, and after an idle gap as long as a decode step.
async fn measure_spawn_blocking() -> Result<(f64, f64)> {
    let mut hot = vec![];
    for _ in 0..OVERHEAD_ITERS {
        let t = Instant::now();
        tokio::task::spawn_blocking(|| ()).await?;
        hot.push(t.elapsed());
    }
    let mut idle = vec![];
    for _ in 0..IDLE_ITERS {
        tokio::time::sleep(IDLE_GAP).await;
        let t = Instant::now();
        tokio::task::spawn_blocking(|| ()).await?;
        idle.push(t.elapsed());
    }
    Ok((median_ms(&hot) * 1e3, median_ms(&idle) * 1e3))
}

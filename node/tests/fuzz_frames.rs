//! Corpus-driven fuzzing of the whole input path: frame decoder, then the session state machine. Each corpus file
//! (node/tests/corpus/*.frame: one or more length-prefixed frames) is replayed as is and under thousands of seeded
//! mutations (bit flips, truncation, splices, length-prefix rewrites). The decoder must never panic or over-read,
//! and every decoded request must get an answer with the cache budget intact. Bounded: a fixed number of
//! executions, a few seconds in CI.
mod common;

use petal_node::handler::StreamState;
use petal_node::ServerContext;
use petal_p2p::PeerId;
use petal_proto::frame::decode_frame;
use petal_proto::pb::{self, request};
use petal_proto::PROTOCOL_VERSION;
use std::path::PathBuf;
use std::sync::Arc;

const MUTATIONS_PER_FILE: usize = 3000;
const MAX_FRAME: usize = 1 << 20;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

fn context() -> (Arc<ServerContext>, String) {
    let ctx = common::stories_context(256, 4, MAX_FRAME, pb::ServerRecord::default());
    let model_id = ctx.model_id.clone();
    (ctx, model_id)
}

/// xorshift64*: deterministic mutations, so a failure reproduces.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..=rng.below(4) {
        match rng.below(5) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 => b.truncate(rng.below(b.len() + 1)),
            2 if !b.is_empty() => {
                let i = rng.below(b.len());
                b.insert(i, rng.next() as u8);
            }
            3 if b.len() >= 4 => {
                // Rewrite the length prefix: too big, too small, or huge.
                let len = [
                    0u32,
                    1,
                    7,
                    u32::MAX,
                    (MAX_FRAME + 1) as u32,
                    rng.next() as u32,
                ][rng.below(6)];
                b[..4].copy_from_slice(&len.to_be_bytes());
            }
            _ => {
                let from = rng.below(b.len() + 1);
                let to = rng.below(b.len() + 1);
                let (lo, hi) = (from.min(to), from.max(to));
                let chunk = b[lo..hi].to_vec();
                b.extend_from_slice(&chunk);
            }
        }
    }
    b
}

/// Decodes every frame in `bytes` and feeds each request to the state machine; returns requests handled.
async fn drive(bytes: &[u8], state: &mut StreamState, ctx: &Arc<ServerContext>) -> usize {
    let mut handled = 0;
    let mut rest = bytes;
    while !rest.is_empty() {
        match decode_frame::<pb::Request>(rest, MAX_FRAME) {
            Ok((req, used)) => {
                assert!(
                    used > 0 && used <= rest.len(),
                    "decoder consumed {used} of {}",
                    rest.len()
                );
                let _ = state.handle(req, ctx).await;
                handled += 1;
                rest = &rest[used..];
            }
            Err(_) => break,
        }
    }
    handled
}

#[tokio::test]
async fn corpus_and_mutations_never_break_the_server() {
    let (ctx, _) = context();
    let mut files: Vec<_> = std::fs::read_dir(corpus_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "frame"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 8,
        "corpus missing: {}",
        corpus_dir().display()
    );
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut executions, mut requests) = (0usize, 0usize);
    for file in &files {
        let seed = std::fs::read(file).unwrap();
        let mut state = StreamState::new(PeerId::random());
        requests += drive(&seed, &mut state, &ctx).await;
        executions += 1;
        for _ in 0..MUTATIONS_PER_FILE {
            requests += drive(&mutate(&seed, &mut rng), &mut state, &ctx).await;
            executions += 1;
            let usage = ctx.admission.usage();
            assert!(usage.tokens_used <= usage.tokens_total);
        }
        drop(state);
        assert_eq!(
            ctx.admission.usage().sessions,
            0,
            "{} leaked sessions",
            file.display()
        );
    }
    eprintln!(
        "fuzz: {executions} inputs from {} corpus files, {requests} requests handled",
        files.len()
    );
}

/// Writes the seed corpus (run once with `--ignored`; the files are checked in).
#[test]
#[ignore]
fn write_corpus() {
    let (ctx, model_id) = context();
    drop(ctx);
    let frame = |kind: request::Kind| {
        petal_proto::frame::encode_frame(&pb::Request { kind: Some(kind) }).to_vec()
    };
    let open = |start, end, max_length| {
        frame(request::Kind::Open(pb::OpenSession {
            protocol_version: PROTOCOL_VERSION,
            model_id: model_id.clone(),
            start_block: start,
            end_block: end,
            max_length,
            max_batch: 1,
        }))
    };
    let step = |id: u64, position, tokens: usize, dtype: pb::WireDType, value: f32| {
        let values = vec![value; tokens * 64];
        frame(request::Kind::Step(pb::Step {
            session_id: id,
            position,
            hidden: Some(petal_proto::tensor::from_f32(
                &values,
                &[1, tokens, 64],
                dtype,
            )),
            ..Default::default()
        }))
    };
    let close = |id| frame(request::Kind::Close(pb::CloseSession { session_id: id }));
    let info = frame(request::Kind::Info(pb::InfoRequest {}));
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("open_full", open(0, 5, 16)),
        ("open_sub_range", open(2, 4, 8)),
        ("open_bad_range", open(4, 9, 8)),
        ("step_f32", step(1, 0, 2, pb::WireDType::F32, 0.5)),
        ("step_f16", step(1, 0, 1, pb::WireDType::F16, 0.5)),
        ("step_nan", step(1, 0, 1, pb::WireDType::F32, f32::NAN)),
        ("close", close(1)),
        ("info", info.clone()),
        (
            "empty_request",
            petal_proto::frame::encode_frame(&pb::Request { kind: None }).to_vec(),
        ),
        ("open_then_info", [open(0, 5, 16), info].concat()),
    ];
    for (name, bytes) in files {
        std::fs::write(corpus_dir().join(format!("{name}.frame")), bytes).unwrap();
    }
}

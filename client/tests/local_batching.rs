//! `LocalSpans` (the blocks of `petal generate --local` and `petal api --local`) batches concurrent sessions through
//! its spans' schedulers: sessions driven at once, from async tasks and from a synchronous caller
//! (`forward_now`), share batches and compute what each computes alone.
use candle_core::Tensor;
use petal_client::blocks::LocalSpansSession;
use petal_client::{BlockSession, LocalSpans, ModelBlocks};
use petal_model::{models_dir, BlockRange, Head, ModelSource, Placement};
use std::sync::Arc;

const SESSIONS: usize = 6;
const NEW_TOKENS: usize = 16;
const MAX_LENGTH: usize = 64;

fn argmax(logits: &Tensor) -> u32 {
    logits
        .flatten_all()
        .unwrap()
        .argmax(0)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap()
}

fn prompt(i: usize, vocab: u32) -> Vec<u32> {
    (0..=i as u32)
        .map(|k| (i as u32 * 41 + k * 13 + 7) % vocab)
        .collect()
}

/// Greedy tokens of one session, stepped with `forward_now` (synchronous) or through `BlockSession::forward`;
/// also the largest batch any of its steps ran in.
async fn generate(
    head: &Head,
    mut session: LocalSpansSession,
    prompt: Vec<u32>,
    sync: bool,
) -> (Vec<u32>, usize) {
    let mut tokens = vec![];
    let mut largest = 0;
    let mut ids = prompt;
    while tokens.len() < NEW_TOKENS {
        let x = head.embed(&ids).unwrap();
        let y = if sync {
            tokio::task::block_in_place(|| session.forward_now(&x)).unwrap()
        } else {
            session.forward(&x).await.unwrap().hidden
        };
        largest = largest.max(session.last_batch().map_or(0, |b| b.sessions));
        let token = argmax(&head.logits(&y).unwrap());
        tokens.push(token);
        ids = vec![token];
    }
    (tokens, largest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_local_sessions_share_batches_and_match_each_alone() {
    let relative = "stories260K/hf";
    let path = models_dir::find_model(relative)
        .unwrap_or_else(|| panic!("{}", models_dir::missing_model(relative)));
    let source = ModelSource::open(path).unwrap();
    let p = Placement::cpu_f32();
    let head = Arc::new(source.load_head(p.clone()).unwrap());
    let vocab = source.spec().vocab_size as u32;
    // Two spans, as a split model would be: each has its own scheduler.
    let spans = vec![
        source.load_span_on(BlockRange::new(0, 2), &p).unwrap(),
        source.load_span_on(BlockRange::new(2, 5), &p).unwrap(),
    ];
    let blocks = LocalSpans::new(spans).unwrap();
    assert_eq!(blocks.schedulers().len(), 2);

    let mut alone = vec![];
    for i in 0..SESSIONS {
        let session = blocks.open_local(MAX_LENGTH).unwrap();
        let (tokens, largest) = generate(&head, session, prompt(i, vocab), i % 2 == 0).await;
        assert_eq!(largest, 1, "a lone session batches with nobody");
        alone.push(tokens);
    }

    // The trait path too: a boxed session from `ModelBlocks::open` steps like the others.
    let mut boxed = blocks.open(MAX_LENGTH).await.unwrap();
    assert_eq!(boxed.position(), 0);
    let x = head.embed(&prompt(0, vocab)).unwrap();
    boxed.forward(&x).await.unwrap();
    assert_eq!(boxed.position(), 1);

    let tasks: Vec<_> = (0..SESSIONS)
        .map(|i| {
            let head = head.clone();
            let session = blocks.open_local(MAX_LENGTH).unwrap();
            // Every other session is a synchronous caller.
            tokio::spawn(
                async move { generate(&head, session, prompt(i, vocab), i % 2 == 0).await },
            )
        })
        .collect();
    let mut largest = 0;
    for (i, (task, alone)) in tasks.into_iter().zip(&alone).enumerate() {
        let (tokens, l) = task.await.unwrap();
        assert_eq!(
            &tokens, alone,
            "session {i}: concurrent tokens differ from the lone run"
        );
        largest = largest.max(l);
    }
    eprintln!("{SESSIONS} concurrent local sessions: largest batch {largest}");
    assert!(
        largest > 1,
        "concurrent local sessions never shared a batch"
    );
}

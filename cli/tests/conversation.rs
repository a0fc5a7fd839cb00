//! `Conversation`: a chat keeps its history in one inference session across turns, sending only each turn's new
//! tokens, and answers exactly as a fresh run over the whole rendered conversation would. Through a real
//! in-process swarm (a bootstrap and two nodes on loopback, as `petal demo` runs), in-process, and through
//! `petal chat` reading a pipe.
use petal_cli::LocalSwarm;
use petal_client::{ChainConfig, Conversation, Generator};
use petal_model::text::prompt::encode_chat;
use petal_model::{models_dir, BlockRange, GenerationConfig, ModelSource, Placement, Tokenizer};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn smollm() -> PathBuf {
    models_dir::default_model()
        .unwrap_or_else(|| panic!("{}", models_dir::missing_model(models_dir::DEFAULT_MODEL)))
}

fn greedy(max_new_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens,
        ..GenerationConfig::default()
    }
}

/// The whole model in this process, as `petal generate --local` runs it.
fn local_generator(source: &ModelSource) -> Generator {
    Generator::local(source, Placement::cpu_f32()).expect("local model")
}

/// The prompt of the conversation's last turn, rendered and encoded from scratch: everything before the last reply.
fn from_scratch_prompt(conversation: &Conversation<'_>, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut messages = conversation.chat_messages(None);
    let last = messages.pop().expect("a reply");
    assert_eq!(last.role, "assistant");
    encode_chat(tokenizer, &messages).expect("render")
}

const QUESTION1: &str = "What is the capital of France?";
const QUESTION2: &str = "And what is the capital of Germany?";

/// Two turns on one generator: the second continues the first's session and equals a fresh run. Returns the
/// replies.
async fn two_turns_reuse_one_session(
    generator: &Generator,
    tokenizer: &Tokenizer,
) -> (String, String) {
    let config = greedy(48);
    let mut conversation = Conversation::new(generator, tokenizer, None).expect("chat template");

    let mut streamed = String::new();
    let first = conversation
        .send(QUESTION1, &config, |t| streamed.push_str(t))
        .await
        .expect("first turn");
    let text1 = first.completion.output.text.clone();
    eprintln!(
        "turn 1: {text1:?} ({} new prompt tokens)",
        first.new_prompt_tokens
    );
    assert!(text1.contains("Paris"), "{text1:?}");
    assert_eq!(streamed, text1, "streamed pieces make up the reply");
    assert!(!first.reused_session);
    let position1 = conversation.position();
    assert_eq!(conversation.processed().len(), position1);

    let second = conversation
        .send(QUESTION2, &config, |_| {})
        .await
        .expect("second turn");
    let text2 = second.completion.output.text.clone();
    eprintln!(
        "turn 2: {text2:?} ({} new prompt tokens, position {position1} -> {})",
        second.new_prompt_tokens,
        conversation.position()
    );
    assert!(
        second.reused_session,
        "the second turn continues the session"
    );
    assert_eq!(conversation.sessions_opened(), 1, "no re-open");
    assert!(conversation.position() > position1 + second.new_prompt_tokens);

    // Only the new tokens were sent: the whole rendered conversation minus what the session held.
    let prompt2 = from_scratch_prompt(&conversation, tokenizer);
    assert_eq!(second.completion.output.prompt_tokens, prompt2.len());
    assert_eq!(second.new_prompt_tokens, prompt2.len() - position1);
    assert!(second.new_prompt_tokens < prompt2.len() / 2);
    // The session held the first reply's tokens, end-of-turn token included (the first new id).
    assert_eq!(
        &prompt2[..position1],
        conversation.processed().get(..position1).expect("held")
    );
    assert!(
        tokenizer.is_eos(prompt2[position1]),
        "the first new id closes the previous reply"
    );

    // The same as generating the second turn from scratch on a fresh session.
    let fresh = generator
        .generate(tokenizer, &prompt2, &config, |_| true)
        .await
        .expect("fresh run");
    assert_eq!(fresh.output.text, text2);
    assert_eq!(fresh.sampled, second.completion.sampled);
    conversation.close().await;
    (text1, text2)
}

/// A completion reports what it cost: one timing per step (the prefill first), each hop's round trip and server
/// compute, the route and the bytes on the wire through the swarm; no hops and no bytes locally.
async fn check_cost(generator: &Generator, source: &ModelSource, hops: usize) {
    let tokenizer = &source.tokenizer(None).expect("tokenizer");
    let prompt =
        petal_model::text::prompt::encode_prompt(tokenizer, QUESTION1, true, None).expect("prompt");
    let c = generator
        .generate(tokenizer, &prompt, &greedy(8), |_| true)
        .await
        .expect("generate");
    let cost = &c.cost;
    assert_eq!(cost.route.len(), hops, "{:?}", cost.route);
    assert_eq!(cost.steps.len(), c.sampled.len());
    assert_eq!(
        cost.steps[0].tokens,
        prompt.len(),
        "the prefill comes first"
    );
    assert!(cost.steps[1..].iter().all(|s| s.tokens == 1));
    assert!(cost.failovers.is_empty());
    for step in &cost.steps {
        assert_eq!(step.hops.len(), hops);
        assert!(step.blocks > Duration::ZERO);
        for hop in &step.hops {
            assert!(
                hop.compute > Duration::ZERO && hop.round_trip >= hop.compute,
                "{hop:?}"
            );
        }
    }
    if hops == 0 {
        assert_eq!(cost.bytes_on_wire, 0);
    } else {
        // Each step sends and receives the hidden states of its tokens on every hop, f32 at least.
        let hidden = generator.head().placement().dtype.size_in_bytes() * source.spec().hidden_size;
        let positions: usize = cost.steps.iter().map(|s| s.tokens).sum();
        assert!(cost.bytes_on_wire >= (2 * hops * positions * hidden) as u64);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swarm_conversation_reuses_one_session() {
    let started = Instant::now();
    let model = smollm();
    let swarm = LocalSwarm::start(
        &model,
        &[BlockRange::new(0, 15), BlockRange::new(15, 30)],
        |_| {},
    )
    .await
    .expect("swarm");
    let client = swarm.client().await.expect("client");
    let source = ModelSource::open(&model).expect("model");
    let tokenizer = source.tokenizer(None).expect("tokenizer");
    let chain = ChainConfig {
        discovery_timeout: Duration::from_secs(30),
        ..ChainConfig::default()
    };
    let generator =
        Generator::remote(&client, &source, Placement::cpu_f32(), chain).expect("remote model");
    eprintln!("swarm up after {:.1?}", started.elapsed());

    two_turns_reuse_one_session(&generator, &tokenizer).await;
    check_cost(&generator, &source, 2).await;

    client.shutdown().await;
    swarm.shutdown().await;
    eprintln!("done after {:.1?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_conversation_reuses_one_session_and_reopens_when_needed() {
    let source = ModelSource::open(smollm()).expect("model");
    let tokenizer = source.tokenizer(None).expect("tokenizer");
    let generator = local_generator(&source);
    let (text1, text2) = two_turns_reuse_one_session(&generator, &tokenizer).await;
    check_cost(&generator, &source, 0).await;

    // Turns that do not fit in the session's window grow the session (the second one continues it rather than
    // re-opening), with the same replies.
    let mut small = Conversation::new(&generator, &tokenizer, None)
        .expect("chat template")
        .with_window(40);
    let a = small
        .send(QUESTION1, &greedy(48), |_| {})
        .await
        .expect("turn");
    let b = small
        .send(QUESTION2, &greedy(48), |_| {})
        .await
        .expect("turn");
    assert!(!a.reused_session && b.reused_session);
    assert_eq!(small.sessions_opened(), 1);
    assert_eq!(
        (a.completion.output.text, b.completion.output.text),
        (text1, text2)
    );
    small.close().await;

    // A reply cut at a stop string inside a token ("...France| is| Paris" cut before "is Paris") is not what the
    // session holds (it processed " is"): the next turn re-opens, and still equals a fresh run.
    let mut conversation = Conversation::new(&generator, &tokenizer, None).expect("chat template");
    let mut config = greedy(32);
    config.stop = vec!["is Paris".into()];
    let first = conversation
        .send("What is the capital of France?", &config, |_| {})
        .await
        .expect("first turn");
    assert_eq!(
        first.completion.output.finish_reason,
        petal_model::FinishReason::Stop
    );
    assert_eq!(first.completion.output.text, "The capital of France ");
    let config = greedy(32);
    let second = conversation
        .send("Thanks. What about Italy?", &config, |_| {})
        .await
        .expect("second turn");
    assert!(!second.reused_session);
    assert_eq!(conversation.sessions_opened(), 2);
    let fresh = generator
        .generate(
            &tokenizer,
            &from_scratch_prompt(&conversation, &tokenizer),
            &config,
            |_| true,
        )
        .await
        .expect("fresh run");
    assert_eq!(fresh.output.text, second.completion.output.text);

    // /reset: a fresh conversation answers the first question as the first time.
    conversation.reset().await;
    assert!(conversation.messages().is_empty());
    let again = conversation
        .send("What is the capital of France?", &greedy(48), |_| {})
        .await
        .expect("after reset");
    assert!(!again.reused_session);
    assert_eq!(conversation.sessions_opened(), 3);
    assert!(again.completion.output.text.contains("Paris"));
    conversation.close().await;
}

#[test]
fn chat_cli_through_a_pipe() {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_petal"))
        .args(["chat", "--local", "--max-new-tokens", "48", "--model"])
        .arg(smollm())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start petal chat");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(
            b"What is the capital of France?\nAnd what is the capital of Germany?\n/reset\n\
              What is the capital of France?\n",
        )
        .expect("write stdin");
    let out = child.wait_with_output().expect("petal chat");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "stdout:\n{stdout}\nstderr:\n{stderr}\n({:.1?})",
        started.elapsed()
    );
    assert!(out.status.success(), "petal chat failed");
    let replies: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(replies.len(), 3, "three replies: {stdout:?}");
    assert!(replies[0].contains("Paris"), "{stdout:?}");
    assert!(replies[1].contains("Berlin"), "{stdout:?}");
    assert_eq!(
        replies[2], replies[0],
        "after /reset the same question gets the same answer"
    );
    assert!(stderr.contains("> "), "prompts go to stderr");
    assert!(stderr.contains("(conversation cleared)"), "{stderr}");
    // The first two turns ran on the first session, the second from where the first left off; /reset opened a
    // second one.
    let stats: Vec<&str> = stderr.lines().filter(|l| l.contains("session ")).collect();
    assert_eq!(stats.len(), 3, "{stderr}");
    assert!(stats[0].contains("session 1 at position"), "{stderr}");
    assert!(stats[1].contains("session 1 at position"), "{stderr}");
    assert!(stats[2].contains("session 2 at position"), "{stderr}");
}

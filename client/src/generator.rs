//! The one decode loop. A [`Generator`] holds the model's local parts (embeddings, final norm, LM head) and its
//! blocks ([`ModelBlocks`]: in this process or on a chain of servers), and generates the same way over either, on
//! a session the caller may keep across calls (a chat keeps one for the whole conversation). `petal generate`,
//! `petal chat`, `petal api`, the demo and the bench all generate through it.
//!
//! The head's compute is synchronous CPU work: on a multi-threaded tokio runtime it runs under `block_in_place`, so
//! the other tasks of the worker (other requests, the swarm actor) move to other threads meanwhile. Local blocks run
//! on their spans' scheduler threads (batched with concurrent sessions), awaited like a remote chain; every step
//! ends at an `.await`, so a task aborted between steps stops.
use crate::blocks::{BlockSession, LocalSpans, ModelBlocks, RemoteChain};
use crate::chain::{ChainConfig, Failover, HopTiming, RouteHop};
use crate::error::{ClientError, Result};
use crate::swarm::SwarmClient;
use crate::verification::VerifyTally;
use candle_core::{DType, Tensor};
use petal_model::text::decoding::{
    Generation, GenerationConfig, GenerationOutput, GenerationTimer, Step,
};
use petal_model::text::sampling::TokenLogprob;
use petal_model::{Head, ModelSource, Placement, Tokenizer};
use serde::Serialize;
use std::time::{Duration, Instant};

/// An open session on a generator's blocks.
pub type Session = Box<dyn BlockSession>;

/// Generates locally or through the swarm, the same way.
pub struct Generator {
    head: Head,
    blocks: Box<dyn ModelBlocks>,
    model_id: String,
    max_position: usize,
    local: bool,
}

/// What one generation produced, and what it cost.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Text, generated ids (without the end-of-sequence token), finish reason and timings; `prompt_tokens` counts
    /// the whole context the reply continues.
    pub output: GenerationOutput,
    /// Every token the model sampled, in order, the final end-of-sequence token included: OpenAI's
    /// `completion_tokens`, and (all but the last) what the session processed after the context.
    pub sampled: Vec<u32>,
    /// True when `on_text` asked to stop (the listener went away) before the generation finished.
    pub cancelled: bool,
    /// With [`GenerationConfig::logprobs`]: one entry per token of `sampled`, in order; otherwise empty.
    pub logprobs: Vec<TokenLogprob>,
    pub cost: Cost,
}

/// Where a completion's time and bytes went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Cost {
    /// `name(peer)[a..b]` per hop at the end of the completion; empty when local.
    pub route: Vec<String>,
    /// The same hops with their peer, blocks and path (direct or relayed).
    pub hops: Vec<RouteHop>,
    /// Bytes sent and received over all hops during this completion.
    pub bytes_on_wire: u64,
    /// Servers replaced during this completion.
    pub failovers: Vec<Failover>,
    /// What the checks of servers' answers found during this completion.
    pub verification: VerifyTally,
    /// One entry per step, in order: the first is the prefill of the context, the rest decode one token each.
    pub steps: Vec<StepTiming>,
}

/// The parts of one step, as the client measured them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepTiming {
    /// Positions the step processed.
    pub tokens: usize,
    #[serde(serialize_with = "crate::serde_ms")]
    pub embed: Duration,
    /// Through every block: local compute, or the whole chain's round trips.
    #[serde(serialize_with = "crate::serde_ms")]
    pub blocks: Duration,
    /// Final norm and LM head.
    #[serde(serialize_with = "crate::serde_ms")]
    pub head: Duration,
    #[serde(serialize_with = "crate::serde_ms")]
    pub sample: Duration,
    /// Per hop of a remote chain: round trip and server compute.
    pub hops: Vec<HopTiming>,
}

impl Generator {
    /// A generator over `blocks`, with `head` here; `model_id` names the exact weights.
    pub fn new(
        head: Head,
        blocks: impl ModelBlocks + 'static,
        model_id: String,
        max_position: usize,
    ) -> Self {
        Self {
            head,
            blocks: Box::new(blocks),
            model_id,
            max_position,
            local: false,
        }
    }

    /// The whole model in this process: head and every block on `placement` (blocks in the dtype the source's
    /// policy picks for it).
    pub fn local(source: &ModelSource, placement: Placement) -> Result<Self> {
        Self::local_with_kv(source, placement, None)
    }

    /// [`Generator::local`] with sessions' keys and values stored in `kv_dtype` (`None`: the blocks' dtype).
    pub fn local_with_kv(
        source: &ModelSource,
        placement: Placement,
        kv_dtype: Option<DType>,
    ) -> Result<Self> {
        let blocks = LocalSpans::load(source, &placement, kv_dtype)?;
        let mut generator = Self::new(
            source.load_head(placement)?,
            blocks,
            source.model_id()?,
            source.spec().max_position,
        );
        generator.local = true;
        Ok(generator)
    }

    /// The head on `placement` here (nothing else is read from `source`), the blocks on the swarm `client` knows.
    pub fn remote(
        client: &SwarmClient,
        source: &ModelSource,
        placement: Placement,
        config: ChainConfig,
    ) -> Result<Self> {
        let model_id = source.model_id()?;
        if source.has_all_weights() {
            client.expect_weights(&model_id, source.manifest()?);
        } else {
            // A hub model of which only the head's shards are here: hashing every block would download them all.
            tracing::info!(model = %model_id, "not checking servers' block hashes: this client holds only the head's weights and trusts the revision pinned in the model id");
        }
        let chain = RemoteChain::new(
            client.clone(),
            model_id.clone(),
            source.spec().num_blocks,
            config,
        );
        Ok(Self::new(
            source.load_head(placement)?,
            chain,
            model_id,
            source.spec().max_position,
        ))
    }

    /// The local parts of the model: embeddings, final norm, LM head.
    pub fn head(&self) -> &Head {
        &self.head
    }

    /// The model id (a fingerprint of the exact weights).
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The model's context length: a session holds at most this many positions.
    pub fn max_position(&self) -> usize {
        self.max_position
    }

    /// Whether every block runs in this process.
    pub fn is_local(&self) -> bool {
        self.local
    }

    /// The positions to open a session with for a prompt of `prompt` ids and up to `max_new` generated ones: the
    /// prompt and at most [`RESERVE_AHEAD`] of the rest. Servers then reserve what the request needs now, not the
    /// whole context for every request that does not say how long it will be; the decode loop extends the
    /// session (doubling) when the generation goes on.
    pub fn reservation_for(&self, prompt: usize, max_new: usize) -> usize {
        (prompt + max_new.min(RESERVE_AHEAD)).min(self.max_position)
    }

    /// A session able to hold `max_length` positions.
    pub async fn open_session(&self, max_length: usize) -> Result<Session> {
        self.blocks.open(max_length).await
    }

    /// Runs `ids` (the next positions of `session`) through the model and returns the last position's logits and
    /// what the step cost (its `sample` left at zero).
    pub async fn step(&self, session: &mut Session, ids: &[u32]) -> Result<(Tensor, StepTiming)> {
        let t0 = Instant::now();
        // A few ids are a few row lookups: handing the worker's core over for them would cost more than they do.
        let hidden = if ids.len() <= INLINE_EMBED_IDS {
            self.head.embed(ids)
        } else {
            compute(|| self.head.embed(ids))
        }?;
        let t1 = Instant::now();
        let out = session.forward(&hidden).await?;
        let t2 = Instant::now();
        // The session's address names it while it lives: the LM head batches the sessions that come back together.
        let caller = (&**session as *const dyn BlockSession).cast::<()>() as usize as u64;
        let logits = self
            .head
            .logits_async(caller, &out.hidden, |f| compute(f))
            .await?;
        let timing = StepTiming {
            tokens: ids.len(),
            embed: t1 - t0,
            blocks: t2 - t1,
            head: t2.elapsed(),
            sample: Duration::ZERO,
            hops: out.hops,
        };
        Ok((logits, timing))
    }

    /// Generates from `prompt` on a session of its own (opened here, closed at the end). `on_text` gets each
    /// completed piece of text and returns whether to go on.
    pub async fn generate(
        &self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        config: &GenerationConfig,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Completion> {
        self.generate_with(Some(tokenizer), prompt, config, on_text)
            .await
    }

    /// [`Generator::generate`] for a model driven by token ids alone (no tokenizer: no text, no end-of-sequence).
    pub async fn generate_ids(
        &self,
        prompt: &[u32],
        config: &GenerationConfig,
    ) -> Result<Completion> {
        self.generate_with(None, prompt, config, |_| true).await
    }

    async fn generate_with(
        &self,
        tokenizer: Option<&Tokenizer>,
        prompt: &[u32],
        config: &GenerationConfig,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Completion> {
        check_fits(prompt.len(), self.max_position)?;
        let max_length = self.reservation_for(prompt.len(), config.max_new_tokens);
        let mut session = self.open_session(max_length).await?;
        let result = self
            .decode(&mut session, tokenizer, prompt, config, |step| {
                on_text(&step.text)
            })
            .await;
        session.close().await;
        result
    }

    /// Generates the continuation of `context` on `session`, which already holds the first
    /// `session.position()` ids of `context` (0 for a fresh session): only the rest is sent. The result is the
    /// same as generating from `context` on a fresh session. `on_text` gets each completed piece of text and
    /// returns whether to go on. The session is extended as the generation needs (see [`Generator::decode`]).
    pub async fn continue_in(
        &self,
        session: &mut Session,
        tokenizer: &Tokenizer,
        context: &[u32],
        config: &GenerationConfig,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Completion> {
        self.decode(session, Some(tokenizer), context, config, |step| {
            on_text(&step.text)
        })
        .await
    }

    /// [`Generator::continue_in`] with the whole of each step: `on_step` gets the sampled token, the text it
    /// completed (possibly empty), whether the generation finished, and the step's log-probabilities when
    /// `config.logprobs` asks; it returns whether to go on.
    pub async fn continue_with(
        &self,
        session: &mut Session,
        tokenizer: &Tokenizer,
        context: &[u32],
        config: &GenerationConfig,
        on_step: impl FnMut(&Step) -> bool,
    ) -> Result<Completion> {
        self.decode(session, Some(tokenizer), context, config, on_step)
            .await
    }

    /// The decode loop. When the next step does not fit in the session, the session is extended: to twice its
    /// length, at most what the generation can still need (the context and `max_new_tokens`) and the model's
    /// context. It stops at the end of the generation or of the model's context.
    async fn decode(
        &self,
        session: &mut Session,
        tokenizer: Option<&Tokenizer>,
        context: &[u32],
        config: &GenerationConfig,
        mut on_step: impl FnMut(&Step) -> bool,
    ) -> Result<Completion> {
        let start = session.position();
        if start >= context.len() {
            return Err(ClientError::Request(format!(
                "the session already holds {start} positions; the context ({} ids) must add at least one",
                context.len()
            )));
        }
        check_fits(context.len(), self.max_position)?;
        let cap = (context.len() + config.max_new_tokens).min(self.max_position);
        let (bytes_before, failovers_before) = (session.bytes_on_wire(), session.failovers().len());
        let verification_before = session.verification();
        let mut generation = Generation::new(tokenizer, context, config)?;
        let mut timer = GenerationTimer::new();
        let mut text = String::new();
        let (mut sampled, mut steps, mut logprobs) = (vec![], vec![], vec![]);
        let mut cancelled = false;
        let mut input = context[start..].to_vec();
        while generation.finished().is_none() {
            let needed = session.position() + input.len();
            if needed > self.max_position {
                break;
            }
            if needed > session.max_length() {
                let grown = (2 * session.max_length()).min(cap).max(needed);
                session.extend(grown).await?;
            }
            let (logits, mut timing) = self.step(session, &input).await?;
            let t = Instant::now();
            let step = compute(|| generation.step(&logits))?;
            timing.sample = t.elapsed();
            timer.tick();
            steps.push(timing);
            sampled.push(step.token);
            text.push_str(&step.text);
            let go_on = on_step(&step);
            logprobs.extend(step.logprob);
            if !go_on {
                cancelled = generation.finished().is_none();
                break;
            }
            input = vec![step.token];
        }
        Ok(Completion {
            output: timer.finish(context.len(), &generation, text),
            sampled,
            cancelled,
            logprobs,
            cost: Cost {
                route: session.route(),
                hops: session.hops(),
                bytes_on_wire: session.bytes_on_wire().saturating_sub(bytes_before),
                failovers: session.failovers()[failovers_before.min(session.failovers().len())..]
                    .to_vec(),
                verification: session.verification().since(&verification_before),
                steps,
            },
        })
    }
}

/// Generated positions a session is opened with beyond its prompt, at most (see [`Generator::reservation_for`]).
pub const RESERVE_AHEAD: usize = 256;

/// A context of `len` ids needs `len` positions, and at least one id.
fn check_fits(len: usize, max_length: usize) -> Result<()> {
    if len == 0 {
        return Err(ClientError::Request(
            "the prompt is empty (no token ids)".into(),
        ));
    }
    if len > max_length {
        return Err(ClientError::Request(format!(
            "a context of {len} tokens does not fit in {max_length} positions"
        )));
    }
    Ok(())
}

/// Ids embedded on the calling task rather than under [`compute`]: a decode step's, or a short chat turn's.
const INLINE_EMBED_IDS: usize = 16;

/// Runs synchronous model compute without stalling the async worker it is called from (see the module docs).
pub fn compute<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

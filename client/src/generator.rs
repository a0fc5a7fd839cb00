//! One generation loop over either the whole model in this process ([`LocalModel`]) or a chain of servers
//! ([`RemoteModel`]), on a session the caller may keep across calls (a chat keeps one for the whole conversation).
//!
//! The model's compute (embeddings, blocks in-process, LM head) is synchronous CPU work: on a multi-threaded tokio
//! runtime it runs under `block_in_place`, so the other tasks of the worker (other requests, the swarm actor)
//! move to other threads meanwhile, and every step ends at an `.await`, so a task aborted between steps stops.
use crate::error::{ClientError, Result};
use crate::remote_model::RemoteModel;
use crate::session::InferenceSession;
use candle_core::Tensor;
use petal_model::generation::{Generation, GenerationConfig, GenerationOutput, GenerationTimer};
use petal_model::tokenizer::Tokenizer;
use petal_model::{Head, LocalModel, ModelError, SpanCache};

/// Generates locally or through the swarm, the same way.
// One per process, so the variants' sizes do not matter; boxing would only add noise at every construction.
#[allow(clippy::large_enum_variant)]
pub enum Generator {
    /// Every block in this process.
    Local(LocalModel),
    /// The blocks on a chain of servers; head and sampling here.
    Remote(RemoteModel),
}

/// Sessions opened by [`Generator::open_session`]: the KV caches of every position processed so far.
pub enum GeneratorSession {
    Local(LocalSession),
    Remote(InferenceSession),
}

/// The in-process equivalent of an [`InferenceSession`]: one [`SpanCache`] per span.
pub struct LocalSession {
    caches: Vec<SpanCache>,
    position: usize,
    max_length: usize,
}

impl GeneratorSession {
    /// Positions processed so far (the next step's first position).
    pub fn position(&self) -> usize {
        match self {
            Self::Local(s) => s.position,
            Self::Remote(s) => s.position(),
        }
    }

    /// Positions the session can hold.
    pub fn max_length(&self) -> usize {
        match self {
            Self::Local(s) => s.max_length,
            Self::Remote(s) => s.max_length(),
        }
    }

    /// `name(peer)[a..b]` per hop through the swarm; empty for a local session.
    pub fn route(&self) -> Vec<String> {
        match self {
            Self::Local(_) => vec![],
            Self::Remote(s) => s.route(),
        }
    }

    /// Frees the session (the servers' KV caches for a remote one).
    pub async fn close(self) {
        if let Self::Remote(s) = self {
            s.close().await;
        }
    }
}

/// What one generation produced.
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
}

impl Generator {
    /// The local parts of the model: embeddings, final norm, LM head.
    pub fn head(&self) -> &Head {
        match self {
            Self::Local(m) => &m.head,
            Self::Remote(m) => m.head(),
        }
    }

    /// The model's context length: a session holds at most this many positions.
    pub fn max_position(&self) -> usize {
        match self {
            Self::Local(m) => m.spans.first().map(|s| s.spec().max_position).unwrap_or(0),
            Self::Remote(m) => m.max_position(),
        }
    }

    pub fn is_local(&self) -> bool {
        matches!(self, Self::Local(_))
    }

    /// A session able to hold `max_length` positions (through the swarm: over a freshly planned chain).
    pub async fn open_session(&self, max_length: usize) -> Result<GeneratorSession> {
        match self {
            Self::Local(m) => {
                let caches = m
                    .spans
                    .iter()
                    .map(|s| s.new_session(s.range(), max_length))
                    .collect::<petal_model::Result<Vec<_>>>()?;
                Ok(GeneratorSession::Local(LocalSession {
                    caches,
                    position: 0,
                    max_length,
                }))
            }
            Self::Remote(m) => Ok(GeneratorSession::Remote(m.open_session(max_length).await?)),
        }
    }

    /// Runs `ids` (the next positions of `session`) through the model and returns the last position's logits.
    pub async fn step(&self, session: &mut GeneratorSession, ids: &[u32]) -> Result<Tensor> {
        let head = self.head();
        let hidden = compute(|| head.embed(ids))?;
        let out = match (self, session) {
            (Self::Local(m), GeneratorSession::Local(s)) => {
                let out = compute(|| -> petal_model::Result<Tensor> {
                    let mut x = hidden;
                    for (span, cache) in m.spans.iter().zip(&mut s.caches) {
                        x = span.forward(&x, s.position, cache)?;
                    }
                    Ok(x)
                })?;
                s.position += ids.len();
                // Let the runtime cancel an aborted request, and other tasks run, between steps.
                tokio::task::yield_now().await;
                out
            }
            (Self::Remote(_), GeneratorSession::Remote(s)) => s.step(&hidden).await?,
            _ => {
                return Err(ModelError::Config(
                    "a session used with a generator that did not open it".into(),
                )
                .into())
            }
        };
        Ok(compute(|| head.logits(&out))?)
    }

    /// Generates from `prompt` on a session of its own (opened here, closed at the end).
    pub async fn generate(
        &self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        config: &GenerationConfig,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Completion> {
        check_fits(prompt.len(), self.max_position())?;
        let max_length = (prompt.len() + config.max_new_tokens).min(self.max_position());
        let mut session = self.open_session(max_length).await?;
        let result = self
            .continue_in(&mut session, tokenizer, prompt, config, on_text)
            .await;
        session.close().await;
        result
    }

    /// Generates the continuation of `context` on `session`, which already holds the first
    /// `session.position()` ids of `context` (0 for a fresh session): only the rest is sent. The result is the
    /// same as generating from `context` on a fresh session. `on_text` gets each completed piece of text and
    /// returns whether to go on. Stops at the end of the generation or when the session is full.
    pub async fn continue_in(
        &self,
        session: &mut GeneratorSession,
        tokenizer: &Tokenizer,
        context: &[u32],
        config: &GenerationConfig,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Completion> {
        let start = session.position();
        if start >= context.len() {
            return Err(ModelError::Config(format!(
                "the session already holds {start} positions; the context ({} ids) must add at least one",
                context.len()
            ))
            .into());
        }
        check_fits(context.len(), session.max_length())?;
        let mut generation = Generation::new(tokenizer, context, config)?;
        let mut timer = GenerationTimer::new();
        let mut text = String::new();
        let mut sampled = vec![];
        let mut cancelled = false;
        let mut input = context[start..].to_vec();
        while generation.finished().is_none()
            && session.position() + input.len() <= session.max_length()
        {
            let logits = self.step(session, &input).await?;
            let step = compute(|| generation.step(&logits))?;
            timer.tick();
            sampled.push(step.token);
            text.push_str(&step.text);
            if !on_text(&step.text) {
                cancelled = generation.finished().is_none();
                break;
            }
            input = vec![step.token];
        }
        Ok(Completion {
            output: timer.finish(context.len(), &generation, text),
            sampled,
            cancelled,
        })
    }
}

/// A context of `len` ids needs `len` positions, and at least one id.
fn check_fits(len: usize, max_length: usize) -> Result<()> {
    if len == 0 {
        return Err(ModelError::Config("the prompt is empty (no token ids)".into()).into());
    }
    if len > max_length {
        return Err(ClientError::Model(ModelError::Config(format!(
            "a context of {len} tokens does not fit in {max_length} positions"
        ))));
    }
    Ok(())
}

/// Runs synchronous model compute without stalling the async worker it is called from (see the module docs).
pub fn compute<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

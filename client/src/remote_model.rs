//! Generation through the swarm: the client keeps embeddings, final norm, LM head and sampling; the blocks run on
//! the chain of servers.
use crate::error::Result;
use crate::session::InferenceSession;
use crate::swarm::SwarmClient;
use petal_model::generation::{Generation, GenerationConfig, GenerationOutput, GenerationTimer};
use petal_model::tokenizer::Tokenizer;
use petal_model::{Head, ModelSource, Placement};
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

/// Time a server gets to answer one request before the client gives up on it.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);

pub struct RemoteModel<'c> {
    client: &'c SwarmClient,
    head: Head,
    model_id: String,
    num_blocks: usize,
    max_position: usize,
    discovery_timeout: Duration,
    last_route: Mutex<Vec<String>>,
    last_bytes: Mutex<u64>,
}

impl<'c> RemoteModel<'c> {
    /// Loads the head (and nothing else) from `source` onto `placement`.
    pub async fn open(
        client: &'c SwarmClient,
        source: &ModelSource,
        placement: Placement,
        discovery_timeout: Duration,
    ) -> Result<Self> {
        Ok(Self {
            client,
            head: source.load_head(placement)?,
            model_id: source.model_id()?,
            num_blocks: source.spec().num_blocks,
            max_position: source.spec().max_position,
            discovery_timeout,
            last_route: Mutex::new(vec![]),
            last_bytes: Mutex::new(0),
        })
    }

    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Opens a session over a freshly planned chain able to hold `max_length` positions.
    pub async fn open_session(&self, max_length: usize) -> Result<InferenceSession> {
        let route = self
            .client
            .plan(
                &self.model_id,
                self.num_blocks,
                &HashSet::new(),
                self.discovery_timeout,
            )
            .await?;
        let session = InferenceSession::open(
            self.client.network(),
            &self.model_id,
            route,
            max_length,
            STEP_TIMEOUT,
        )
        .await?;
        if let Ok(mut r) = self.last_route.lock() {
            *r = session.route();
        }
        Ok(session)
    }

    /// Generates from `prompt` ids exactly as local generation does, calling `on_text` with each completed piece.
    pub async fn generate(
        &self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        config: &GenerationConfig,
        mut on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput> {
        let max_length = (prompt.len() + config.max_new_tokens).min(self.max_position);
        let mut session = self.open_session(max_length).await?;
        let mut generation = Generation::new(tokenizer, prompt, config)?;
        let mut timer = GenerationTimer::new();
        let mut text = String::new();
        let mut input = prompt.to_vec();
        let result = async {
            while generation.finished().is_none() && session.position() + input.len() <= max_length
            {
                let hidden = self.head.embed(&input)?;
                let out = session.step(&hidden).await?;
                let step = generation.step(&self.head.logits(&out)?)?;
                timer.tick();
                on_text(&step.text);
                text.push_str(&step.text);
                input = vec![step.token];
            }
            Ok::<_, crate::ClientError>(())
        }
        .await;
        if let Ok(mut b) = self.last_bytes.lock() {
            *b = session.bytes_on_wire();
        }
        session.close().await;
        result?;
        Ok(timer.finish(prompt.len(), &generation, text))
    }

    /// The chain the last session used.
    pub fn last_route(&self) -> Vec<String> {
        self.last_route
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// Bytes sent and received over all hops by the last generation.
    pub fn last_bytes_on_wire(&self) -> u64 {
        self.last_bytes.lock().map(|b| *b).unwrap_or(0)
    }
}

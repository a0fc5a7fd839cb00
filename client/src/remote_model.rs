//! Generation through the swarm: the client keeps embeddings, final norm, LM head and sampling; the blocks run on
//! the chain of servers.
use crate::error::Result;
use crate::session::{Failover, InferenceSession, SessionConfig};
use crate::swarm::SwarmClient;
use petal_model::generation::{Generation, GenerationConfig, GenerationOutput, GenerationTimer};
use petal_model::tokenizer::Tokenizer;
use petal_model::{Head, ModelSource, Placement};
use std::sync::Mutex;
use std::time::Duration;

pub struct RemoteModel {
    client: SwarmClient,
    head: Head,
    model_id: String,
    num_blocks: usize,
    max_position: usize,
    discovery_timeout: Duration,
    last_route: Mutex<Vec<String>>,
    last_bytes: Mutex<u64>,
    last_failovers: Mutex<Vec<Failover>>,
}

impl RemoteModel {
    /// Loads the head (and nothing else) from `source` onto `placement`.
    pub async fn open(
        client: &SwarmClient,
        source: &ModelSource,
        placement: Placement,
        discovery_timeout: Duration,
    ) -> Result<Self> {
        Ok(Self {
            client: client.clone(),
            head: source.load_head(placement)?,
            model_id: source.model_id()?,
            num_blocks: source.spec().num_blocks,
            max_position: source.spec().max_position,
            discovery_timeout,
            last_route: Mutex::new(vec![]),
            last_bytes: Mutex::new(0),
            last_failovers: Mutex::new(vec![]),
        })
    }

    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The local parts of the model: embeddings, final norm, LM head.
    pub fn head(&self) -> &Head {
        &self.head
    }

    /// The model's context length: a session holds at most this many positions.
    pub fn max_position(&self) -> usize {
        self.max_position
    }

    /// Opens a session over a freshly planned chain able to hold `max_length` positions.
    pub async fn open_session(&self, max_length: usize) -> Result<InferenceSession> {
        let config = SessionConfig {
            discovery_timeout: self.discovery_timeout,
            ..SessionConfig::default()
        };
        InferenceSession::open(
            &self.client,
            &self.model_id,
            self.num_blocks,
            max_length,
            config,
        )
        .await
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
        if let Ok(mut r) = self.last_route.lock() {
            *r = session.route();
        }
        if let Ok(mut f) = self.last_failovers.lock() {
            *f = session.failovers().to_vec();
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

    /// Servers replaced during the last generation.
    pub fn last_failovers(&self) -> Vec<Failover> {
        self.last_failovers
            .lock()
            .map(|f| f.clone())
            .unwrap_or_default()
    }

    /// Bytes sent and received over all hops by the last generation.
    pub fn last_bytes_on_wire(&self) -> u64 {
        self.last_bytes.lock().map(|b| *b).unwrap_or(0)
    }
}

//! A chat that keeps its history in one inference session across turns.
//!
//! Every turn renders the whole conversation through the model's chat template, exactly as a one-shot prompt
//! would be. When the session already holds a prefix of those ids (the previous turns: prompts, replies and the
//! reply's end-of-turn token, which was sampled but not yet processed), only the rest is sent, so a turn costs
//! its new tokens rather than the whole history, and generates what a fresh session given the whole rendered
//! conversation would. The session is re-opened (and the whole conversation sent again) only when the rendering
//! no longer starts with what it holds (a reply cut at a stop string, a template that rewrites earlier turns), when
//! the turn would not fit in it, or when a reused session fails before the turn produced any text.
use crate::error::{ClientError, Result};
use crate::generator::{Completion, Generator, Session};
use petal_model::text::chat::ChatMessage;
use petal_model::text::decoding::GenerationConfig;
use petal_model::text::prompt::encode_chat;
use petal_model::text::tokenizer::Tokenizer;
use petal_model::ModelError;

/// Positions a conversation's session holds unless a turn needs more (capped at the model's context).
pub const DEFAULT_WINDOW: usize = 2048;

/// One exchange's result.
#[derive(Debug, Clone)]
pub struct Turn {
    pub completion: Completion,
    /// Ids sent before generating: the part of the rendered conversation the session did not hold yet.
    pub new_prompt_tokens: usize,
    /// Whether the turn continued the previous turn's session (false for the first turn and after a re-open).
    pub reused_session: bool,
}

pub struct Conversation<'g> {
    generator: &'g Generator,
    tokenizer: &'g Tokenizer,
    system: Option<String>,
    /// User and assistant turns so far (the system message is added when rendering).
    messages: Vec<ChatMessage>,
    session: Option<Session>,
    /// The ids the session has processed, in order (`session.position()` of them).
    processed: Vec<u32>,
    window: usize,
    sessions_opened: usize,
}

impl<'g> Conversation<'g> {
    /// A conversation with `system` as its system message (an empty one when `None`, see
    /// [`petal_model::text::prompt::chat_messages`]). Fails when the model has no chat template.
    pub fn new(
        generator: &'g Generator,
        tokenizer: &'g Tokenizer,
        system: Option<String>,
    ) -> Result<Self> {
        if tokenizer.chat_template().is_none() {
            return Err(ModelError::ChatTemplate(
                "this model has no chat template (tokenizer_config.json or GGUF metadata); chat needs one".into(),
            )
            .into());
        }
        Ok(Self {
            generator,
            tokenizer,
            system,
            messages: vec![],
            session: None,
            processed: vec![],
            window: DEFAULT_WINDOW,
            sessions_opened: 0,
        })
    }

    /// Positions a session is opened for (at least what the turn needs, at most the model's context); it grows as the
    /// conversation goes on.
    pub fn with_window(mut self, positions: usize) -> Self {
        self.window = positions;
        self
    }

    /// The user and assistant turns so far.
    pub fn messages(&self) -> &[ChatMessage] {
        &self.messages
    }

    /// The conversation as the template renders it: the system message, the turns, and `next_user` if given.
    pub fn chat_messages(&self, next_user: Option<&str>) -> Vec<ChatMessage> {
        let mut messages = Vec::with_capacity(self.messages.len() + 2);
        messages.push(ChatMessage::system(self.system.as_deref().unwrap_or("")));
        messages.extend(self.messages.iter().cloned());
        messages.extend(next_user.map(ChatMessage::user));
        messages
    }

    /// The ids the current session has processed.
    pub fn processed(&self) -> &[u32] {
        &self.processed
    }

    /// The current session's position (0 without a session).
    pub fn position(&self) -> usize {
        self.session.as_ref().map_or(0, |s| s.position())
    }

    /// Sessions opened so far (1 after any number of turns that all continued the first one).
    pub fn sessions_opened(&self) -> usize {
        self.sessions_opened
    }

    /// The current session's chain through the swarm (empty when local or without a session).
    pub fn route(&self) -> Vec<String> {
        self.session.as_ref().map(|s| s.route()).unwrap_or_default()
    }

    /// Sends a user message and generates the assistant's reply, calling `on_text` with each completed piece.
    /// On success both messages join the history; on error the history is unchanged and the session is dropped
    /// (the next turn opens a new one).
    pub async fn send(
        &mut self,
        user: &str,
        config: &GenerationConfig,
        mut on_text: impl FnMut(&str),
    ) -> Result<Turn> {
        let ids = encode_chat(self.tokenizer, &self.chat_messages(Some(user)))?;
        let max_position = self.generator.max_position();
        if ids.len() >= max_position {
            return Err(ClientError::Request(format!(
                "the conversation is {} tokens long, the model's context is {max_position}: reset it",
                ids.len()
            )));
        }
        let needed = self
            .generator
            .reservation_for(ids.len(), config.max_new_tokens);
        let reusable = self.session.as_ref().is_some_and(|s| {
            s.position() == self.processed.len()
                && ids.len() > self.processed.len()
                && ids.starts_with(&self.processed)
        });
        if reusable {
            let mut emitted = false;
            let result = self.run(&ids, config, &mut on_text, &mut emitted).await;
            match result {
                Ok(completion) => return Ok(self.finish(user, &ids, completion, true)),
                // Nothing shown yet (e.g. a server evicted the idle session): start over on a fresh session.
                Err(e) if !emitted => {
                    tracing::warn!(error = %e, "the conversation's session failed; re-opening it");
                }
                Err(e) => {
                    self.drop_session().await;
                    return Err(e);
                }
            }
        } else if self.session.is_some() {
            tracing::debug!(
                held = self.processed.len(),
                rendered = ids.len(),
                needed,
                "the session cannot continue this conversation; re-opening it"
            );
        }
        self.drop_session().await;
        // A conversation that outgrew the window gets half a window of headroom, not a re-open every turn.
        let max_length = if needed <= self.window {
            self.window
        } else {
            needed + self.window / 2
        }
        .min(max_position);
        self.session = Some(self.generator.open_session(max_length).await?);
        self.sessions_opened += 1;
        let mut emitted = false;
        match self.run(&ids, config, &mut on_text, &mut emitted).await {
            Ok(completion) => Ok(self.finish(user, &ids, completion, false)),
            Err(e) => {
                self.drop_session().await;
                Err(e)
            }
        }
    }

    /// Forgets the history and closes the session.
    pub async fn reset(&mut self) {
        self.messages.clear();
        self.drop_session().await;
    }

    /// Closes the session.
    pub async fn close(mut self) {
        self.drop_session().await;
    }

    async fn run(
        &mut self,
        ids: &[u32],
        config: &GenerationConfig,
        on_text: &mut impl FnMut(&str),
        emitted: &mut bool,
    ) -> Result<Completion> {
        let Some(session) = self.session.as_mut() else {
            return Err(ClientError::Request(
                "the conversation has no session".into(),
            ));
        };
        let new_prompt_tokens = ids.len() - session.position();
        tracing::debug!(
            position = session.position(),
            new_prompt_tokens,
            "conversation turn"
        );
        self.generator
            .continue_in(session, self.tokenizer, ids, config, |text| {
                *emitted |= !text.is_empty();
                on_text(text);
                true
            })
            .await
    }

    /// Records a successful turn: the messages, and the ids the session now holds (the rendered conversation and
    /// every sampled token it processed; the last sampled token, e.g. the end-of-turn token, is processed by the
    /// next turn, as the first id of its rendering after this one's).
    fn finish(&mut self, user: &str, ids: &[u32], completion: Completion, reused: bool) -> Turn {
        let position = self.position();
        let held_before = if reused { self.processed.len() } else { 0 };
        let mut processed = ids.to_vec();
        processed.extend_from_slice(&completion.sampled);
        processed.truncate(position);
        self.processed = processed;
        self.messages.push(ChatMessage::user(user));
        self.messages
            .push(ChatMessage::assistant(completion.output.text.clone()));
        Turn {
            new_prompt_tokens: ids.len() - held_before,
            completion,
            reused_session: reused,
        }
    }

    async fn drop_session(&mut self) {
        self.processed.clear();
        if let Some(session) = self.session.take() {
            session.close().await;
        }
    }
}

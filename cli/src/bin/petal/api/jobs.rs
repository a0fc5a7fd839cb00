//! Request validation: an OpenAI request body into a [`Job`] (prompt ids and generation config), or the
//! OpenAI-style error that says what is wrong with it.
use super::state::AppState;
use super::types::*;
use petal_model::text::chat::ChatMessage;
use petal_model::text::decoding::GenerationConfig;
use petal_model::text::prompt::encode_chat;
use petal_model::text::sampling::{SamplingParams, MAX_PENALTY};
use petal_model::text::tokenizer::Tokenizer;
use serde_json::Value;

/// Most stop strings a request may give (OpenAI allows 4).
const MAX_STOPS: usize = 16;
/// Most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit).
const MAX_TOP_LOGPROBS: i64 = 20;
/// OpenAI's default `max_tokens` for `/v1/completions`; chat completions default to the rest of the context.
const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// Which endpoint a job answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A validated request.
pub struct Job {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub prompt: Vec<u32>,
    pub config: GenerationConfig,
    pub stream: bool,
    pub include_usage: bool,
}

impl Job {
    /// Whether the answer reports log-probabilities.
    pub fn logprobs(&self) -> bool {
        self.config.logprobs.is_some()
    }
}

/// A `/v1/completions` request: one prompt (text or token ids), encoded with the model's BOS convention.
pub fn completion_job(
    state: &AppState,
    req: CompletionRequest,
    sampling: &SamplingFields,
) -> Result<Job, ApiError> {
    state.check_model(&req.model)?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid(Some("echo"), "echo is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(Some("suffix"), "suffix is not supported"));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid(
            Some("best_of"),
            "Only best_of=1 is supported: this server generates one completion per request",
        ));
    }
    let logprobs = req
        .logprobs
        .map(|k| top_logprobs(k, "logprobs"))
        .transpose()?;
    let one = "Only one prompt per request is supported";
    let prompt = match req.prompt {
        Prompt::Text(text) => encode(&state.tokenizer, &text)?,
        Prompt::Texts(mut texts) if texts.len() == 1 => encode(&state.tokenizer, &texts.remove(0))?,
        Prompt::Ids(ids) => check_ids(&state.tokenizer, ids)?,
        Prompt::IdLists(mut lists) if lists.len() == 1 => {
            check_ids(&state.tokenizer, lists.remove(0))?
        }
        _ => return Err(ApiError::invalid(Some("prompt"), one)),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            Some("prompt"),
            "The prompt is empty (it encodes to no tokens)",
        ));
    }
    job(
        state,
        Endpoint::Completions,
        prompt,
        sampling,
        "prompt",
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        logprobs,
    )
}

/// How many alternatives per token: 0..=[`MAX_TOP_LOGPROBS`].
fn top_logprobs(k: i64, param: &str) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&k) {
        return Err(ApiError::invalid(
            Some(param),
            format!("{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        ));
    }
    Ok(k as usize)
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    tokenizer
        .encode(text, true)
        .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))
}

fn check_ids(tokenizer: &Tokenizer, ids: Vec<u32>) -> Result<Vec<u32>, ApiError> {
    match ids
        .iter()
        .find(|&&id| id as usize >= tokenizer.vocab_size())
    {
        Some(bad) => Err(ApiError::invalid(
            Some("prompt"),
            format!(
                "Token id {bad} is outside the vocabulary of {} tokens",
                tokenizer.vocab_size()
            ),
        )),
        None => Ok(ids),
    }
}

/// A `/v1/chat/completions` request: the messages rendered through the model's chat template.
pub fn chat_job(
    state: &AppState,
    req: ChatRequest,
    sampling: &SamplingFields,
) -> Result<Job, ApiError> {
    state.check_model(&req.model)?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), k) => Some(top_logprobs(k.unwrap_or(0), "top_logprobs")?),
        (_, Some(k)) if k != 0 => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "top_logprobs needs logprobs set to true",
            ))
        }
        _ => None,
    };
    match &req.tool_choice {
        None | Some(Value::Null) => {}
        Some(Value::String(choice)) if choice == "auto" || choice == "none" => {}
        Some(choice) => {
            return Err(ApiError::invalid(
                Some("tool_choice"),
                format!(
                    "tool_choice {choice} is not supported: this server answers in text and cannot be made \
                     to call a tool (tools are accepted with tool_choice \"auto\" or \"none\")"
                ),
            ))
        }
    }
    if let Some(tools) = req.tools.as_ref().filter(|t| !t.is_empty()) {
        tracing::debug!(
            tools = tools.len(),
            "tools accepted and not offered to the model: it answers in text"
        );
    }
    if let Some(format) = &req.response_format {
        let kind = format.get("type").and_then(Value::as_str);
        if kind != Some("text") {
            return Err(ApiError::invalid(
                Some("response_format"),
                format!(
                    "response_format {format} is not supported: this server cannot constrain the answer \
                     to JSON (only {{\"type\": \"text\"}})"
                ),
            ));
        }
    }
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "messages must hold at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    for (i, m) in req.messages.into_iter().enumerate() {
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(text)) => text,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                Some(&format!("messages[{i}].content")),
                                format!("Only text content parts are supported, not {kind:?}"),
                            ))
                        }
                    }
                }
                text
            }
        };
        let role = match m.role.as_str() {
            "developer" => "system".to_string(),
            "" => {
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].role")),
                    "A message's role must not be empty",
                ))
            }
            other => other.to_string(),
        };
        messages.push(ChatMessage::new(role, content));
    }
    // As `petal generate --chat`: an explicit empty system turn, so templates add no default persona.
    if messages.first().is_some_and(|m| m.role != "system") {
        messages.insert(0, ChatMessage::system(""));
    }
    let prompt = encode_chat(&state.tokenizer, &messages)
        .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
    job(
        state,
        Endpoint::Chat,
        prompt,
        sampling,
        "messages",
        None,
        logprobs,
    )
}

/// Checks the sampling fields against the prompt and the model's context.
fn job(
    state: &AppState,
    endpoint: Endpoint,
    prompt: Vec<u32>,
    f: &SamplingFields,
    prompt_param: &str,
    default_max_tokens: Option<usize>,
    logprobs: Option<usize>,
) -> Result<Job, ApiError> {
    if f.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            Some("n"),
            "Only n=1 is supported: this server generates one choice per request",
        ));
    }
    if f.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::invalid(
            Some("logit_bias"),
            "logit_bias is not supported",
        ));
    }
    let context = state.generator.max_position();
    let too_long = |completion: Option<i64>, param: &str| {
        let asked = match completion {
            Some(c) => format!(
                "{} tokens ({} in the {prompt_param}, {c} in the completion)",
                (prompt.len() as i64).saturating_add(c),
                prompt.len()
            ),
            None => format!("{} tokens in the {prompt_param} alone", prompt.len()),
        };
        ApiError::invalid(
            Some(param),
            format!(
                "This model's maximum context length is {context} tokens. However, you requested {asked}. \
                 Please reduce the length of the {prompt_param} or completion."
            ),
        )
        .with_code("context_length_exceeded")
    };
    if prompt.len() >= context {
        return Err(too_long(None, prompt_param));
    }
    let room = context - prompt.len();
    let (asked, param) = match (f.max_completion_tokens, f.max_tokens) {
        (Some(v), _) => (Some(v), "max_completion_tokens"),
        (None, v) => (v, "max_tokens"),
    };
    let max_new_tokens = match asked {
        Some(v) if v < 1 => {
            return Err(ApiError::invalid(
                Some(param),
                format!("{param} must be at least 1, got {v}"),
            ))
        }
        Some(v) if v as u64 > room as u64 => {
            return Err(too_long(Some(v), param));
        }
        Some(v) => v as usize,
        None => default_max_tokens.unwrap_or(room).min(room),
    };
    let temperature = f.temperature.unwrap_or(1.0);
    if !temperature.is_finite() || !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            Some("temperature"),
            format!("temperature must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = match f.top_p {
        Some(p) if !p.is_finite() || p <= 0.0 || p > 1.0 => {
            return Err(ApiError::invalid(
                Some("top_p"),
                format!("top_p must be in (0, 1], got {p}"),
            ))
        }
        Some(p) if p < 1.0 => Some(p),
        _ => None,
    };
    let stop: Vec<String> = match &f.stop {
        None => vec![],
        Some(OneOrMany::One(s)) => vec![s.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            Some("stop"),
            format!("At most {MAX_STOPS} stop strings are supported"),
        ));
    }
    let max = MAX_PENALTY as f64;
    let penalty = |value: Option<f64>, param: &str| match value {
        None => Ok(0.0),
        Some(v) if v.is_finite() && (-max..=max).contains(&v) => Ok(v as f32),
        Some(v) => Err(ApiError::invalid(
            Some(param),
            format!("{param} must be between -{max} and {max}, got {v}"),
        )),
    };
    let sampling = SamplingParams {
        temperature,
        // vLLM's -1 and llama.cpp's 0 both mean "off".
        top_k: f.top_k.filter(|&k| k > 0).map(|k| k as usize),
        top_p,
        repeat_penalty: f.repetition_penalty.unwrap_or(1.0),
        repeat_last_n: 64,
        presence_penalty: penalty(f.presence_penalty, "presence_penalty")?,
        frequency_penalty: penalty(f.frequency_penalty, "frequency_penalty")?,
        seed: f.seed.map_or_else(rand::random, |s| s as u64),
    };
    sampling
        .validate()
        .map_err(|e| ApiError::invalid(None, e.to_string()))?;
    Ok(Job {
        endpoint,
        id: response_id(match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        }),
        created: now(),
        prompt,
        config: GenerationConfig {
            max_new_tokens,
            sampling,
            stop,
            ignore_eos: false,
            logprobs,
        },
        stream: f.stream.unwrap_or(false),
        include_usage: f
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

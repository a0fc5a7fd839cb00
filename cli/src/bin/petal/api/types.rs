//! OpenAI's request and response shapes (the subset Petal serves), and its error format.
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------------------------
// Errors

/// An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds to send as `Retry-After` (429 answers).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// 404 for a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        Self::invalid(
            Some("model"),
            format!("The model `{asked}` does not exist; this server serves `{served}`"),
        )
        .with_code("model_not_found")
        .with_status(StatusCode::NOT_FOUND)
    }

    /// 503: the swarm could not run the request (no servers for some blocks, servers failing, timeouts).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("swarm_unavailable"),
            retry_after: None,
        }
    }

    /// 500: something failed in this process.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 429: no generation slot free and no room to wait for one; the client should retry after `seconds`.
    pub fn overloaded(message: impl Into<String>, seconds: u64) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("server_overloaded"),
            retry_after: Some(seconds),
        }
    }

    /// 504: the request ran past `--request-timeout` (`limit`) after it got its slot; its generation was stopped.
    ///
    /// 504 rather than 408: 408 says the server gave up waiting for the client to send its request (and asks the
    /// client to close the connection), which is not what happened; here the request arrived whole and the
    /// server (a gateway to the swarm's servers, which did not finish in time) gave up on the answer.
    pub fn timeout(limit: std::time::Duration) -> Self {
        Self {
            status: StatusCode::GATEWAY_TIMEOUT,
            message: format!(
                "The request did not finish within {} s, this server's time limit per request; its generation \
                 was stopped. Ask for fewer tokens (max_tokens) or retry later",
                limit.as_secs_f64()
            ),
            kind: "timeout_error",
            param: None,
            code: Some("request_timeout"),
            retry_after: None,
        }
    }

    /// Maps a generation failure: the swarm's troubles are 503, this process's own are 500.
    pub fn from_client(e: &petal_client::ClientError) -> Self {
        match e {
            petal_client::ClientError::Model(_) | petal_client::ClientError::LocalCompute(_) => {
                Self::internal(e.to_string())
            }
            petal_client::ClientError::Request(reason) => Self::invalid(None, reason.clone()),
            _ => Self::unavailable(e.to_string()),
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, message = %self.message, "request failed");
        } else {
            tracing::debug!(status = %self.status, message = %self.message, "request refused");
        }
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Requests. Unknown fields (`user`, `store`, `metadata`, `parallel_tool_calls`, ...) are ignored; known fields
// Petal cannot honour are refused where silently ignoring them would change the answer's meaning (`n` > 1,
// `best_of` > 1, `echo`, `suffix`, `logit_bias`, `tool_choice` that forces a tool call, `response_format` other
// than text).

/// A string or a list of strings (`stop`, `prompt`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `prompt` of a completion: text, a list of texts, token ids, or lists of token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling fields common to both endpoints, read from the same body as the endpoint's own fields (not with
/// `#[serde(flatten)]`, which would lose the name of a bad field).
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extension (vLLM, llama.cpp): sample among the K most likely tokens.
    pub top_k: Option<i64>,
    /// Extension (vLLM): candle's repeat penalty (1.0 = off).
    pub repetition_penalty: Option<f32>,
    /// OpenAI's penalties over the generated tokens, -2..=2.
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Refused unless empty.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    /// The legacy form: how many alternatives to report per token (0 = the chosen token's logprob only).
    pub logprobs: Option<i64>,
    pub best_of: Option<i64>,
}

/// Message content: a string, or a list of parts of which only text parts are supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    /// Absent or null for an assistant turn that only called tools.
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    /// With `logprobs: true`: how many alternatives to report per token.
    pub top_logprobs: Option<i64>,
    /// Accepted and not used: the model answers in text. Refused only with a `tool_choice` that forces a call.
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
}

/// Parses a request body as a JSON object.
pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            None,
            format!("We could not parse the JSON body of your request: {e}"),
        )
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            None,
            "The request body must be a JSON object",
        ));
    }
    Ok(value)
}

/// Reads a request's fields from its body, naming the offending field in the error.
pub fn parse_fields<T: serde::de::DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let inner = e.inner().to_string();
        let path = e.path().to_string();
        // A missing field is reported at its parent; name the field itself.
        let param = match inner.strip_prefix("missing field `") {
            Some(rest) => {
                let field = rest.split('`').next().unwrap_or_default();
                if path == "." {
                    field.to_string()
                } else {
                    format!("{path}.{field}")
                }
            }
            None => path,
        };
        let message = if inner.starts_with("missing field") {
            format!("Missing required parameter: '{param}'.")
        } else if inner.contains("did not match any variant") {
            format!("Invalid type for '{param}'.")
        } else {
            format!("Invalid value for '{param}': {inner}")
        };
        ApiError::invalid(Some(&param), message)
    })
}

// ---------------------------------------------------------------------------------------------------------------
// Responses

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// OpenAI's finish reasons: `stop` for an end-of-sequence token or a stop string, `length` otherwise.
pub fn finish_reason(reason: petal_model::FinishReason) -> &'static str {
    match reason {
        petal_model::FinishReason::Eos | petal_model::FinishReason::Stop => "stop",
        petal_model::FinishReason::Length => "length",
    }
}

/// Seconds since the UNIX epoch, for `created`.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh response id with OpenAI's prefixes (`cmpl-`, `chatcmpl-`).
pub fn response_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of<T: serde::de::DeserializeOwned + std::fmt::Debug>(body: &str) -> ApiError {
        let value = parse_json(body.as_bytes()).expect("a JSON object");
        parse_fields::<T>(&value).expect_err("an invalid request")
    }

    #[test]
    fn bad_bodies_name_the_offending_field() {
        assert_eq!(
            parse_json(b"{nope").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert!(parse_json(b"[1]")
            .unwrap_err()
            .message
            .contains("JSON object"));
        let e = error_of::<CompletionRequest>(r#"{"prompt": "x"}"#);
        assert_eq!(e.param.as_deref(), Some("model"));
        assert_eq!(e.kind, "invalid_request_error");
        let e = error_of::<SamplingFields>(r#"{"max_tokens": "many"}"#);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = error_of::<ChatRequest>(r#"{"model": "m", "messages": [{"content": "hi"}]}"#);
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = error_of::<CompletionRequest>(r#"{"model": "m", "prompt": {"a": 1}}"#);
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }

    #[test]
    fn timeouts_are_typed_504s() {
        let e = ApiError::timeout(std::time::Duration::from_millis(1500));
        assert_eq!(e.status, StatusCode::GATEWAY_TIMEOUT);
        let body = e.body();
        assert_eq!(body["error"]["type"], "timeout_error");
        assert_eq!(body["error"]["code"], "request_timeout");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("within 1.5 s"), "{message}");
        assert!(ApiError::timeout(std::time::Duration::from_secs(600))
            .message
            .contains("within 600 s"));
    }

    #[test]
    fn unknown_fields_and_both_stop_forms_are_accepted() {
        let value = parse_json(
            br#"{"model": "m", "prompt": ["a"], "stop": "x", "whatever": [1, {"b": null}]}"#,
        )
        .expect("object");
        let req: CompletionRequest = parse_fields(&value).expect("valid");
        assert!(matches!(req.prompt, Prompt::Texts(ref t) if t.len() == 1));
        let sampling: SamplingFields = parse_fields(&value).expect("valid");
        assert!(matches!(sampling.stop, Some(OneOrMany::One(ref s)) if s == "x"));
        let value = parse_json(br#"{"stop": ["x", "y"], "prompt": [1, 2]}"#).expect("object");
        let sampling: SamplingFields = parse_fields(&value).expect("valid");
        assert!(matches!(sampling.stop, Some(OneOrMany::Many(ref s)) if s.len() == 2));
    }

    #[test]
    fn logprobs_tools_and_penalties_parse() {
        let value = parse_json(
            br#"{"model": "m", "messages": [], "logprobs": true, "top_logprobs": 3, "presence_penalty": 0.5,
                 "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
                 "user": "u", "logit_bias": {}}"#,
        )
        .expect("object");
        let chat: ChatRequest = parse_fields(&value).expect("valid");
        assert_eq!((chat.logprobs, chat.top_logprobs), (Some(true), Some(3)));
        assert_eq!(chat.tools.map(|t| t.len()), Some(1));
        assert_eq!(chat.tool_choice, Some(json!("auto")));
        let sampling: SamplingFields = parse_fields(&value).expect("valid");
        assert_eq!(sampling.presence_penalty, Some(0.5));
        assert!(sampling.logit_bias.is_some_and(|b| b.is_empty()));
        // Chat's `logprobs` is a boolean; the legacy completions' is a count.
        let e = error_of::<ChatRequest>(r#"{"model": "m", "messages": [], "logprobs": 3}"#);
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let value = parse_json(br#"{"model": "m", "prompt": "x", "logprobs": 3}"#).expect("object");
        let completion: CompletionRequest = parse_fields(&value).expect("valid");
        assert_eq!(completion.logprobs, Some(3));
    }

    #[test]
    fn errors_have_openai_shape() {
        let body = ApiError::unknown_model("gpt-4", "petal").body();
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["param"], "model");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("gpt-4")));
        assert_eq!(
            ApiError::unavailable("x").status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}

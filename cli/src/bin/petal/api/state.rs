//! What the endpoints share: the model, its tokenizer, the API's names for it, and the concurrency limit.
use petal_client::Generator;
use petal_model::Tokenizer;
use tokio::task::JoinHandle;

pub struct AppState {
    pub generator: Generator,
    pub tokenizer: Tokenizer,
    /// The name clients give as `model`.
    pub name: String,
    /// The weights' fingerprint, also accepted as `model`.
    pub model_id: String,
    pub created: u64,
    /// OpenAI's `system_fingerprint`: `petal-<version>-<first 12 hex digits of the weights' fingerprint>`, which
    /// changes when either the server or the weights do.
    pub fingerprint: String,
    /// Generation slots and the queue for them.
    pub admission: super::admission::Admission,
    pub metrics: super::metrics::ApiMetrics,
}

/// [`AppState::fingerprint`] for a model id (`<name>-<hex digest>`).
pub fn system_fingerprint(model_id: &str) -> String {
    let digest = model_id.rsplit('-').next().unwrap_or(model_id);
    let short: String = digest.chars().take(12).collect();
    format!("petal-{}-{short}", env!("CARGO_PKG_VERSION"))
}

/// Aborts a generation task when the request that owns it goes away (the client disconnected).
pub struct AbortOnDrop<T>(pub JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

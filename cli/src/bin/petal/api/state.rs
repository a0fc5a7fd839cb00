//! What the endpoints share: the model, its tokenizer, the API's names for it, and the concurrency limit.
use super::types::ApiError;
use petal_client::Generator;
use petal_model::Tokenizer;
use std::future::Future;
use tokio::task::JoinHandle;
use tokio::time::Instant;

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

impl AppState {
    /// `work`, given until `deadline` (a request's [`super::admission::Slot::deadline`]; `None`: no limit). Past
    /// it, `work` is dropped with what it owns (a half-opened session, a slot), the timeout counted, and the
    /// answer is the 504 of [`ApiError::timeout`].
    pub async fn before<T>(
        &self,
        deadline: Option<Instant>,
        work: impl Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        let (Some(deadline), Some(limit)) = (deadline, self.admission.request_timeout()) else {
            return work.await;
        };
        match tokio::time::timeout_at(deadline, work).await {
            Ok(result) => result,
            Err(_) => {
                self.metrics.timed_out();
                Err(ApiError::timeout(limit))
            }
        }
    }
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

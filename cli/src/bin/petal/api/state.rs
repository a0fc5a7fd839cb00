//! What the endpoints share: the model, its tokenizer, the API's names for it, and the concurrency limit.
use petal_client::Generator;
use petal_model::Tokenizer;
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

pub struct AppState {
    pub generator: Generator,
    pub tokenizer: Tokenizer,
    /// The name clients give as `model`.
    pub name: String,
    /// The weights' fingerprint, also accepted as `model`.
    pub model_id: String,
    pub created: u64,
    pub permits: Arc<Semaphore>,
}

/// Aborts a generation task when the request that owns it goes away (the client disconnected).
pub struct AbortOnDrop<T>(pub JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

//! Who may generate now. At most `--max-concurrent` requests hold a slot; up to `--max-queue` more wait for one,
//! each for at most `--queue-timeout`; anything beyond is answered `429` with `Retry-After` at once, before its body
//! is parsed or tokenized, so a flood costs the server next to nothing and never grows an unbounded queue.
use super::types::ApiError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Seconds a refused client is told to wait before trying again.
const RETRY_AFTER_SECONDS: u64 = 1;

#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_queue: usize,
    queue_timeout: Duration,
}

/// Counts a request as waiting while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Admission {
    /// Requests waiting for a slot now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    pub fn new(max_concurrent: usize, max_queue: usize, queue_timeout: Duration) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            waiting: AtomicUsize::new(0),
            max_queue,
            queue_timeout,
        }
    }

    /// A slot: at once if one is free, after waiting in the queue if it has room, else a 429.
    pub async fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        let ahead = self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiting);
        if ahead >= self.max_queue {
            return Err(ApiError::overloaded(
                format!("the server is busy: {ahead} requests are already waiting; retry later"),
                RETRY_AFTER_SECONDS,
            ));
        }
        match tokio::time::timeout(self.queue_timeout, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(_)) => Err(ApiError::internal("the server is shutting down")),
            Err(_) => Err(ApiError::overloaded(
                format!(
                    "no generation slot came free within {:.0} s; retry later",
                    self.queue_timeout.as_secs_f64()
                ),
                RETRY_AFTER_SECONDS,
            )),
        }
    }
}

//! Who may generate now, and for how long. At most `--max-concurrent` requests hold a slot; up to `--max-queue` more
//! wait for one, each for at most `--queue-timeout`; anything beyond is answered `429` with `Retry-After` at once,
//! before its body is parsed or tokenized, so a flood costs the server next to nothing and never grows an unbounded
//! queue. A request holding a slot must be answered within `--request-timeout` of getting it ([`Slot::deadline`]).
//!
//! Inside the slot limit, the CPU-heavy preparation of a request (JSON, chat template, tokenizer: most of a second
//! of CPU for a prompt of megabytes) runs on the blocking pool, a bounded number at once ([`Admission::cpu`]; `petal
//! api` allows one fewer than the machine has cores, at least one): more would not finish any sooner, and CPU-bound
//! threads on every core starve the async runtime's workers, so that even `GET /v1/models` waits for the
//! scheduler. Measured on 2 cores during the API tests' storm (200 prompts of 2 MB at once, 72 of them tokenized):
//! with 8 preparing at once `/v1/models` waited up to 141 ms, with 2 up to 32 ms, with 1 up to 12 ms (the storm
//! then took 1.6 times as long to get through: the price of the core kept for everything else).
use super::types::ApiError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Seconds a refused client is told to wait before trying again.
const RETRY_AFTER_SECONDS: u64 = 1;

#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    /// Preparations running on the blocking pool.
    cpu: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_queue: usize,
    queue_timeout: Duration,
    request_timeout: Option<Duration>,
}

/// A generation slot, held until the request is answered (a stream: until its last event).
#[derive(Debug)]
pub struct Slot {
    pub permit: OwnedSemaphorePermit,
    /// When the request must be done by (`--request-timeout` after it got the slot); `None`: no limit.
    pub deadline: Option<Instant>,
}

/// Counts a request as waiting while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Admission {
    /// `request_timeout`: how long a request may hold its slot (`None` or zero: no limit); `preparers`: how many
    /// requests are prepared at once (at least one).
    pub fn new(
        max_concurrent: usize,
        max_queue: usize,
        queue_timeout: Duration,
        request_timeout: Option<Duration>,
        preparers: usize,
    ) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            cpu: Arc::new(Semaphore::new(preparers.max(1))),
            waiting: AtomicUsize::new(0),
            max_queue,
            queue_timeout,
            request_timeout: request_timeout.filter(|t| !t.is_zero()),
        }
    }

    /// Requests waiting for a slot now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// `--request-timeout`; `None`: no limit.
    pub fn request_timeout(&self) -> Option<Duration> {
        self.request_timeout
    }

    /// A slot: at once if one is free, after waiting in the queue if it has room, else a 429. The request's time
    /// limit starts now.
    pub async fn admit(&self) -> Result<Slot, ApiError> {
        let permit = self.permit().await?;
        Ok(Slot {
            permit,
            deadline: self.request_timeout.map(|t| Instant::now() + t),
        })
    }

    async fn permit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
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

    /// A turn to prepare a request (held by the blocking job that parses and tokenizes it); requests that hold a
    /// slot take turns, first come first served.
    pub async fn cpu(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.cpu
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("the server is shutting down"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_carry_the_request_deadline() {
        let limit = Duration::from_secs(5);
        let limited = Admission::new(1, 0, Duration::from_secs(1), Some(limit), 1);
        let before = Instant::now();
        let slot = limited.admit().await.unwrap();
        let deadline = slot.deadline.unwrap();
        assert!(before + limit <= deadline && deadline <= Instant::now() + limit);
        // The only slot is taken and nobody may wait: refused at once.
        let refused = limited.admit().await.unwrap_err();
        assert_eq!(refused.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        drop(slot);
        assert!(limited.admit().await.is_ok());
        for none in [None, Some(Duration::ZERO)] {
            let unlimited = Admission::new(1, 0, Duration::from_secs(1), none, 1);
            assert_eq!(unlimited.request_timeout(), None);
            assert_eq!(unlimited.admit().await.unwrap().deadline, None);
        }
    }

    #[tokio::test]
    async fn preparations_are_bounded() {
        let admission = Admission::new(8, 0, Duration::from_secs(1), None, 2);
        let a = admission.cpu().await.unwrap();
        let _b = admission.cpu().await.unwrap();
        assert!(admission.cpu.clone().try_acquire_owned().is_err());
        drop(a);
        assert!(admission.cpu().await.is_ok());
        // None at once would stall every request: at least one.
        assert_eq!(
            Admission::new(1, 0, Duration::from_secs(1), None, 0)
                .cpu
                .available_permits(),
            1
        );
    }
}

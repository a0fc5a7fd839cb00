//! Admission control: a KV-cache budget in tokens and a cap on sessions. A session holds a [`Reservation`] for its
//! whole life; dropping it (close, timeout, disconnect, error) gives the tokens back, whatever path ends it.
use petal_proto::pb::ErrorCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub tokens_used: usize,
    pub tokens_total: usize,
    pub sessions: usize,
}

impl Usage {
    pub fn tokens_free(&self) -> usize {
        self.tokens_total.saturating_sub(self.tokens_used)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("server busy: {0} sessions open, the limit")]
    Busy(usize),
    #[error("KV cache full: {asked} tokens asked, {free} free of {total}")]
    CacheFull {
        asked: usize,
        free: usize,
        total: usize,
    },
    #[error("server is shutting down")]
    ShuttingDown,
}

impl Refusal {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Busy(_) => ErrorCode::Busy,
            Self::CacheFull { .. } => ErrorCode::CacheFull,
            Self::ShuttingDown => ErrorCode::ShuttingDown,
        }
    }
}

pub struct Admission {
    max_sessions: usize,
    draining: AtomicBool,
    usage: Mutex<Usage>,
    changes: watch::Sender<Usage>,
}

impl Admission {
    pub fn new(cache_tokens: usize, max_sessions: usize) -> Arc<Self> {
        let usage = Usage {
            tokens_used: 0,
            tokens_total: cache_tokens,
            sessions: 0,
        };
        Arc::new(Self {
            max_sessions,
            draining: AtomicBool::new(false),
            usage: Mutex::new(usage),
            changes: watch::Sender::new(usage),
        })
    }

    /// Reserves `tokens` positions of KV cache for a new session, or says at once why not.
    pub fn admit(self: &Arc<Self>, tokens: usize) -> Result<Reservation, Refusal> {
        if self.draining.load(Ordering::Acquire) {
            return Err(Refusal::ShuttingDown);
        }
        let mut u = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        if u.sessions >= self.max_sessions {
            return Err(Refusal::Busy(u.sessions));
        }
        if tokens > u.tokens_free() {
            return Err(Refusal::CacheFull {
                asked: tokens,
                free: u.tokens_free(),
                total: u.tokens_total,
            });
        }
        u.tokens_used += tokens;
        u.sessions += 1;
        self.changes.send_replace(*u);
        Ok(Reservation {
            admission: self.clone(),
            tokens,
        })
    }

    /// Refuses every new session from now on (SIGTERM); running ones continue.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn usage(&self) -> Usage {
        *self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Usage changes, for the DHT record and metrics.
    pub fn subscribe(&self) -> watch::Receiver<Usage> {
        self.changes.subscribe()
    }

    fn release(&self, tokens: usize) {
        let mut u = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        u.tokens_used = u.tokens_used.saturating_sub(tokens);
        u.sessions = u.sessions.saturating_sub(1);
        self.changes.send_replace(*u);
    }
}

/// A session's claim on the cache budget, released on drop.
#[derive(Debug)]
pub struct Reservation {
    admission: Arc<Admission>,
    tokens: usize,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("usage", &self.usage())
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.admission.release(self.tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_enforced_and_released() {
        let a = Admission::new(100, 3);
        let r1 = a.admit(40).unwrap();
        let _r2 = a.admit(40).unwrap();
        assert_eq!(
            a.admit(40).unwrap_err(),
            Refusal::CacheFull {
                asked: 40,
                free: 20,
                total: 100
            }
        );
        drop(r1);
        let _r3 = a.admit(40).unwrap();
        assert_eq!(a.usage().sessions, 2);
        let _r4 = a.admit(10).unwrap();
        assert_eq!(a.admit(1).unwrap_err(), Refusal::Busy(3));
    }

    #[test]
    fn draining_refuses_new_sessions() {
        let a = Admission::new(100, 3);
        let r = a.admit(10).unwrap();
        a.drain();
        assert_eq!(a.admit(1).unwrap_err(), Refusal::ShuttingDown);
        drop(r);
        assert_eq!(a.usage().tokens_used, 0);
    }
}

//! Continuous batching for one span: a [`SpanScheduler`] owns the compute of one `Arc<BlockSpan>` on a dedicated
//! OS thread, and every session's step goes through it. On the CPU that thread is the first worker of the span's
//! own compute pool ([`OwnPool`]), so a batch starts computing on the thread that took it.
//!
//! A caller moves its session's [`SpanCache`] in with the step ([`SessionStep`]) and gets it back with the output
//! ([`Stepped`]), whether the step succeeded or failed. The thread waits for at least one step, then takes
//! everything queued at that moment, oldest first, up to a row budget ([`DEFAULT_MAX_BATCH_ROWS`] rows, a row
//! being one position of one sequence; a step is never split, and a step larger than the budget runs in a batch
//! of its own), and runs it as one [`BlockSpan::forward_batch`]. Steps that arrive while a batch computes go into
//! the next one: a step waits for at most the batch running when it arrived, plus, when more rows than the budget
//! are queued ahead of it, the batches those need.
//!
//! When sessions of the last two batches have no step queued, the thread first waits a little for them
//! ([`Gathering`], at most [`MAX_GATHER`]): they are most likely computing their next input at that moment (a
//! client's LM head, the previous node's blocks). A small batch run at once would make them wait for it and then
//! run without it, each batch paying for a pass over the weights: with 16 sessions on two cores, batches settled
//! into 15 and 1, or two groups of about 8 taking turns.
//!
//! Each step is checked on its own by `forward_batch`, so a bad step fails alone and leaves its session as it was.
//! A panic inside a batch is caught: every step of that batch fails with [`SchedulerError::Panicked`] (their
//! caches may be half-updated), and the thread goes on serving. The thread ends when every handle is dropped and
//! the queue is empty.
use crate::compute::gathering::Gathering;
use crate::compute::pool::{OwnPool, PoolWaker};
use crate::compute::span::{BatchStep, BlockSpan, SpanCache};
use crate::error::ModelError;
use candle_core::Tensor;
use std::collections::VecDeque;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Rows (positions x sequences, summed over the steps) one batch takes at most, unless a single step is larger.
pub const DEFAULT_MAX_BATCH_ROWS: usize = 2048;

/// The longest a batch waits for the sessions of the last batches, whatever the last batch took (see
/// [`Gathering`] for the share of its compute time that limits it first).
const MAX_GATHER: Duration = Duration::from_millis(50);

/// Why a step got no output.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// The step itself was refused or failed (bad shape, out-of-order position, too long, a tensor error), said by
    /// the span; a refused step left its session as it was.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The batch the step ran in panicked; the session's cache may be half-updated and should be dropped.
    #[error("the batch this step ran in failed: {0}")]
    Panicked(String),
    /// The scheduler's thread is gone (it panicked outside a batch); the step's cache is lost.
    #[error("the span scheduler has stopped")]
    Stopped,
    /// The operating system refused to start the scheduler's thread.
    #[error("cannot start the span scheduler's thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// One session's next step: hidden states `[batch, tokens, hidden_size]` for positions `position..`, and the
/// session's cache, moved in for the step and handed back in [`Stepped`].
pub struct SessionStep {
    pub hidden: Tensor,
    pub position: usize,
    pub cache: SpanCache,
}

/// A step's answer: the session's cache back, the output, and the batch it ran in.
pub struct Stepped {
    pub cache: SpanCache,
    pub output: Result<Tensor, SchedulerError>,
    pub batch: BatchInfo,
}

/// One batch as the scheduler ran it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchInfo {
    /// Steps (sessions) in the batch.
    pub sessions: usize,
    /// Rows of all its steps together.
    pub rows: usize,
    /// Wall time of the batched forward (outputs synchronised with their device).
    pub compute: Duration,
    /// How long the thread waited for sessions of the last batches to join this one ([`SpanScheduler`]'s docs).
    pub gathered: Duration,
}

/// Called on the scheduler's thread once per batch, after it computed and before its steps are answered.
pub type BatchObserver = Arc<dyn Fn(&BatchInfo) + Send + Sync>;

/// How to start a [`SpanScheduler`].
pub struct SchedulerBuilder {
    span: Arc<BlockSpan>,
    max_rows: usize,
    observer: Option<BatchObserver>,
    gather_limit: Option<Duration>,
}

impl SchedulerBuilder {
    /// Rows one batch takes at most (at least 1); a single larger step still runs, alone.
    pub fn max_rows(mut self, rows: usize) -> Self {
        self.max_rows = rows.max(1);
        self
    }

    /// Waits at most `limit` for the sessions of the last batches to join a batch, instead of a share of the last
    /// batch's compute time ([`Duration::ZERO`]: never wait).
    pub fn gather_limit(mut self, limit: Duration) -> Self {
        self.gather_limit = Some(limit);
        self
    }

    /// Calls `f` once per batch (e.g. to record metrics).
    pub fn on_batch(mut self, f: impl Fn(&BatchInfo) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(f));
        self
    }

    /// Starts the scheduler's thread.
    pub fn start(self) -> Result<SpanScheduler, SchedulerError> {
        let (tx, rx) = mpsc::channel();
        let ahead = Arc::new(WakeAhead::default());
        let actor = Actor {
            span: self.span.clone(),
            rx,
            ahead: ahead.clone(),
            max_rows: self.max_rows,
            observer: self.observer,
            gathering: Gathering::new(MAX_GATHER, self.gather_limit),
            pending: VecDeque::new(),
        };
        std::thread::Builder::new()
            .name(format!("petal-batch-{}", self.span.range()))
            .spawn(move || actor.run())
            .map_err(SchedulerError::Spawn)?;
        Ok(SpanScheduler {
            span: self.span,
            tx,
            ahead,
        })
    }
}

/// A handle to one span's scheduler; cheap to clone. The thread ends when the last handle is dropped (after
/// answering what is still queued).
#[derive(Clone)]
pub struct SpanScheduler {
    span: Arc<BlockSpan>,
    tx: mpsc::Sender<Message>,
    ahead: Arc<WakeAhead>,
}

/// Wakes a span's compute pool when a step is queued, while the scheduler's thread wakes, rather than after it: in
/// a chain every hop's first block otherwise waits for the second wake-up. Only when the batch will start at once:
/// one that waits for other sessions first ([`Gathering`]) would find the pool asleep again, and its threads would
/// have spun meanwhile on cores that those sessions' steps need.
#[derive(Default)]
struct WakeAhead {
    /// Set by the scheduler's thread once its pool runs (never on a GPU, which has no pool).
    waker: OnceLock<PoolWaker>,
    /// Whether the next batch runs without waiting for anyone ([`Gathering::one_caller`]).
    next_runs_at_once: AtomicBool,
}

impl SpanScheduler {
    /// A scheduler for `span` with the default row budget and no observer.
    pub fn start(span: Arc<BlockSpan>) -> Result<Self, SchedulerError> {
        Self::builder(span).start()
    }

    pub fn builder(span: Arc<BlockSpan>) -> SchedulerBuilder {
        SchedulerBuilder {
            span,
            max_rows: DEFAULT_MAX_BATCH_ROWS,
            observer: None,
            gather_limit: None,
        }
    }

    /// The span this scheduler computes.
    pub fn span(&self) -> &Arc<BlockSpan> {
        &self.span
    }

    /// Queues `step` and resolves to its answer. The step is queued now, not when the future is first polled;
    /// dropping the future before it resolves drops the session's cache with the answer.
    pub fn step(&self, step: SessionStep) -> PendingStep {
        let (tx, rx) = oneshot::channel();
        match self.send(Message::One(Job::new(step, Reply::Async(tx)))) {
            Ok(()) => PendingStep(Some(rx)),
            Err(()) => PendingStep(None),
        }
    }

    /// Queues several sessions' steps at the same moment: they run in one batch when they fit the row budget.
    /// The answers come in the order of `steps`.
    pub fn step_all(&self, steps: impl IntoIterator<Item = SessionStep>) -> Vec<PendingStep> {
        let (jobs, pending): (Vec<Job>, Vec<PendingStep>) = steps
            .into_iter()
            .map(|s| {
                let (tx, rx) = oneshot::channel();
                (Job::new(s, Reply::Async(tx)), PendingStep(Some(rx)))
            })
            .unzip();
        match self.send(Message::Many(jobs)) {
            Ok(()) => pending,
            Err(()) => pending.into_iter().map(|_| PendingStep(None)).collect(),
        }
    }

    /// [`SpanScheduler::step`] for synchronous callers: blocks this thread until the step's batch has run. Do not
    /// call it on an async worker thread (use `block_in_place`, or `step` and `.await`).
    pub fn step_blocking(&self, step: SessionStep) -> Result<Stepped, SchedulerError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Message::One(Job::new(step, Reply::Blocking(tx))))
            .map_err(|()| SchedulerError::Stopped)?;
        rx.recv().map_err(|_| SchedulerError::Stopped)
    }

    fn send(&self, message: Message) -> Result<(), ()> {
        if let Some(waker) = self.ahead.waker.get() {
            if self.ahead.next_runs_at_once.load(Ordering::Relaxed) {
                let _ = waker.wake();
            }
        }
        self.tx.send(message).map_err(|_| {
            tracing::error!(span = %self.span.range(), "the span scheduler's thread is gone");
        })
    }
}

/// The answer to one queued step: resolves to [`Stepped`], or to [`SchedulerError::Stopped`] if the scheduler's
/// thread is gone.
pub struct PendingStep(Option<oneshot::Receiver<Stepped>>);

impl Future for PendingStep {
    type Output = Result<Stepped, SchedulerError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.0.as_mut() {
            Some(rx) => Pin::new(rx)
                .poll(cx)
                .map(|r| r.map_err(|_| SchedulerError::Stopped)),
            None => Poll::Ready(Err(SchedulerError::Stopped)),
        }
    }
}

enum Message {
    One(Job),
    Many(Vec<Job>),
}

enum Reply {
    Async(oneshot::Sender<Stepped>),
    Blocking(mpsc::SyncSender<Stepped>),
}

impl Reply {
    /// Whether nobody waits for the answer any more (an async caller dropped its future).
    fn abandoned(&self) -> bool {
        match self {
            Reply::Async(tx) => tx.is_closed(),
            Reply::Blocking(_) => false,
        }
    }

    fn send(self, answer: Stepped) {
        // A caller that went away drops its session with the answer; nothing else to do.
        let _ = match self {
            Reply::Async(tx) => tx.send(answer).map_err(|_| ()),
            Reply::Blocking(tx) => tx.send(answer).map_err(|_| ()),
        };
    }
}

struct Job {
    step: SessionStep,
    rows: usize,
    reply: Reply,
}

impl Job {
    fn new(step: SessionStep, reply: Reply) -> Self {
        // Rows of a well-formed `[batch, tokens, hidden]` step; anything else counts one row and is refused by
        // the span in its batch.
        let rows = match step.hidden.dims() {
            [batch, tokens, _] => batch.saturating_mul(*tokens).max(1),
            _ => 1,
        };
        Self { step, rows, reply }
    }
}

struct Actor {
    span: Arc<BlockSpan>,
    rx: mpsc::Receiver<Message>,
    ahead: Arc<WakeAhead>,
    max_rows: usize,
    observer: Option<BatchObserver>,
    /// Whom a batch waits for, by session ([`SpanCache::id`]).
    gathering: Gathering,
    /// Steps received but not yet run, oldest first.
    pending: VecDeque<Job>,
}

impl Actor {
    fn run(mut self) {
        tracing::debug!(span = %self.span.range(), max_rows = self.max_rows, "span scheduler started");
        let pool = OwnPool::on_this_thread(
            &self.span.input_placement().device,
            &format!("petal-compute-{}", self.span.range()),
        );
        if let Some(waker) = pool.waker() {
            let _ = self.ahead.waker.set(waker);
        }
        self.ahead.next_runs_at_once.store(true, Ordering::Relaxed);
        loop {
            if self.pending.is_empty() {
                match self.rx.recv() {
                    Ok(message) => self.queue(message),
                    // Every handle is gone and nothing is queued.
                    Err(mpsc::RecvError) => break,
                }
            }
            // Everything queued at this moment.
            while let Ok(message) = self.rx.try_recv() {
                self.queue(message);
            }
            let gathered = self.gather();
            let batch = self.next_batch();
            if !batch.is_empty() {
                let sessions = batch.iter().map(|j| j.step.cache.id()).collect();
                let info = self.run_batch(&pool, batch, gathered);
                self.gathering.ran(sessions, info.compute);
                self.ahead
                    .next_runs_at_once
                    .store(self.gathering.one_caller(), Ordering::Relaxed);
            }
        }
        tracing::debug!(span = %self.span.range(), "span scheduler stopped");
    }

    fn queue(&mut self, message: Message) {
        match message {
            Message::One(job) => self.pending.push_back(job),
            Message::Many(jobs) => self.pending.extend(jobs),
        }
    }

    /// Waits for the sessions of the last two batches that have no step queued, while the queued rows leave room
    /// in the budget, up to the [`Gathering`] limit; sessions still missing then are forgotten. Returns how long it
    /// waited.
    fn gather(&mut self) -> Duration {
        let started = Instant::now();
        let deadline = started + self.gathering.limit();
        let waited = |w: bool| if w { started.elapsed() } else { Duration::ZERO };
        let mut has_waited = false;
        loop {
            let queued = self.queued_sessions();
            let rows = self.pending.iter().map(|j| j.rows).sum::<usize>();
            if !self.gathering.missing(&queued) || rows >= self.max_rows {
                return waited(has_waited);
            }
            if queued.is_empty() {
                // Nothing to run yet: the loop's first `recv` waits for a step, not this.
                return Duration::ZERO;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            has_waited = true;
            match self.rx.recv_timeout(left) {
                Ok(message) => self.queue(message),
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => return waited(true),
            }
        }
        let queued = self.queued_sessions();
        self.gathering.forget_missing(&queued);
        tracing::trace!(queued = queued.len(), "stopped waiting for steps");
        waited(has_waited)
    }

    /// The sessions ([`SpanCache::id`]) of the pending steps.
    fn queued_sessions(&self) -> Vec<u64> {
        self.pending.iter().map(|j| j.step.cache.id()).collect()
    }

    /// The oldest pending steps that fit the row budget (at least one), skipping those nobody waits for.
    fn next_batch(&mut self) -> Vec<Job> {
        let mut batch = Vec::new();
        let mut rows = 0usize;
        while let Some(job) = self.pending.front() {
            if !batch.is_empty() && rows.saturating_add(job.rows) > self.max_rows {
                break;
            }
            let Some(job) = self.pending.pop_front() else {
                break;
            };
            if job.reply.abandoned() {
                tracing::debug!("step abandoned by its caller before it ran; skipped");
                continue;
            }
            rows = rows.saturating_add(job.rows);
            batch.push(job);
        }
        batch
    }

    fn run_batch(&self, pool: &OwnPool, batch: Vec<Job>, gathered: Duration) -> BatchInfo {
        let sessions = batch.len();
        let rows = batch.iter().map(|j| j.rows).sum::<usize>();
        let mut caches = Vec::with_capacity(sessions);
        let mut inputs = Vec::with_capacity(sessions);
        let mut replies = Vec::with_capacity(sessions);
        for job in batch {
            caches.push(job.step.cache);
            inputs.push((job.step.hidden, job.step.position));
            replies.push(job.reply);
        }
        let started = Instant::now();
        let outputs = {
            let _span = tracing::trace_span!("batch", sessions, rows).entered();
            let mut steps: Vec<BatchStep<'_>> = inputs
                .into_iter()
                .zip(caches.iter_mut())
                .map(|((hidden, position), cache)| BatchStep {
                    hidden,
                    position,
                    cache,
                })
                .collect();
            let span = &self.span;
            match catch_unwind(AssertUnwindSafe(|| {
                let outputs = pool.run(|| span.forward_batch(&mut steps));
                // GPU kernels run asynchronously: wait for them, so the batch's compute time is its real one.
                for out in outputs.iter().flatten() {
                    if let Err(e) = out.device().synchronize() {
                        tracing::warn!(error = %e, "cannot synchronise the device after a batch");
                    }
                }
                outputs
            })) {
                Ok(outputs) if outputs.len() == sessions => outputs
                    .into_iter()
                    .map(|r| r.map_err(SchedulerError::from))
                    .collect(),
                Ok(outputs) => {
                    let reason =
                        format!("{} outputs for a batch of {sessions} steps", outputs.len());
                    tracing::error!(%reason, "batched forward broke its contract");
                    (0..sessions)
                        .map(|_| Err(SchedulerError::Panicked(reason.clone())))
                        .collect::<Vec<_>>()
                }
                Err(payload) => {
                    let reason = panic_message(payload.as_ref());
                    tracing::error!(%reason, sessions, rows, "batched forward panicked; its steps fail");
                    (0..sessions)
                        .map(|_| Err(SchedulerError::Panicked(reason.clone())))
                        .collect::<Vec<_>>()
                }
            }
        };
        let info = BatchInfo {
            sessions,
            rows,
            compute: started.elapsed(),
            gathered,
        };
        if let Some(observer) = &self.observer {
            if catch_unwind(AssertUnwindSafe(|| observer(&info))).is_err() {
                tracing::warn!("the batch observer panicked");
            }
        }
        for ((cache, output), reply) in caches.into_iter().zip(outputs).zip(replies) {
            reply.send(Stepped {
                cache,
                output,
                batch: info,
            });
        }
        info
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

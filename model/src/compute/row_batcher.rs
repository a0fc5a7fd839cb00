//! One computation for the rows of concurrent callers: the LM head of every session of a client that reaches it at
//! the same time runs as one matmul, which reads the head's weights once instead of once per session.
//!
//! There is no thread of its own (a lone caller pays no hand-off): each caller queues its rows; when no batch is
//! computing, a caller whose rows are still queued computes everything queued, its own rows included, answers the
//! others and wakes them. A caller waits for at most the batch computing when it arrived, plus its own.
//!
//! Each waiting caller sleeps on its own ([`std::thread::park`]) and is woken by its answer, not by the batch's
//! end: sixteen callers woken together on one condvar would each take the shared lock in turn, a context switch
//! apiece, before any could go on (1 ms of a 20 ms round on two cores). Async callers ([`RowBatcher::run_async`])
//! wait as tasks and hold no thread: of a client's sessions only the one that computes a batch leaves its worker.
//!
//! Callers that come together tend to come back together, but not at the same instant, so callers name themselves
//! (a session), and the one about to compute first waits for the callers of the last batches that have not queued
//! yet ([`Gathering`], at most [`MAX_GATHER`]).
//!
//! The function must compute each row independently of the others (ours do: activations are quantized by row and
//! every output element is one row's dot product), so a batched answer is the unbatched one, bit for bit. If the
//! batch fails, each caller's rows are computed again alone, so an error reaches only the rows that cause it.
use crate::compute::gathering::Gathering;
use crate::error::{ModelError, Result};
use candle_core::Tensor;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::Thread;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The longest a batch waits for the callers of the last batches, whatever the last batch took.
const MAX_GATHER: Duration = Duration::from_millis(5);

/// A caller's answer, filled by whoever computes its rows, and who to wake when it is.
struct Answer {
    result: Mutex<Option<Result<Tensor>>>,
    waiter: Waiter,
}

/// A waiting caller: a thread ([`RowBatcher::run`]) or an async task ([`RowBatcher::run_async`]).
enum Waiter {
    Thread(Thread),
    Task(Arc<Notify>),
}

/// What a queued caller does next.
enum Next {
    Answered(Result<Tensor>),
    Compute,
    Wait,
}

type Slot = Arc<Answer>;

struct Request {
    caller: u64,
    rows: Tensor,
    answer: Slot,
}

/// What callers share, under one lock.
struct State {
    /// Rows not taken by a batch yet.
    queue: Vec<Request>,
    /// Whether a caller is gathering or computing a batch.
    computing: bool,
    gathering: Gathering,
}

impl State {
    /// The callers whose rows are queued.
    fn queued_callers(&self) -> Vec<u64> {
        self.queue.iter().map(|r| r.caller).collect()
    }
}

/// Batches concurrent calls of one row-wise computation; see the module docs.
pub struct RowBatcher {
    state: Mutex<State>,
    /// Signalled when rows are queued (the gathering caller waits on it).
    arrived: Condvar,
    stats: Mutex<BatchStats>,
}

impl Default for RowBatcher {
    fn default() -> Self {
        Self::with_gathering(Gathering::new(MAX_GATHER, None))
    }
}

/// What a [`RowBatcher`] has run so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Computations run (batches, each of one or more callers).
    pub batches: u64,
    /// Callers answered.
    pub calls: u64,
    /// The most callers one batch answered.
    pub largest: usize,
    /// Batches that waited for callers before computing.
    pub gathered: u64,
}

/// Locks `m`, whatever a panicking holder left behind: the data stays consistent (a request is either queued or
/// answered, see [`Unanswered`]; a batch's end is marked by [`Computing`]).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RowBatcher {
    pub fn new() -> Self {
        Self::default()
    }

    /// A batcher whose batches wait at most `limit` for the callers of the last two batches.
    pub fn with_gather_limit(limit: Duration) -> Self {
        Self::with_gathering(Gathering::new(MAX_GATHER, Some(limit)))
    }

    fn with_gathering(gathering: Gathering) -> Self {
        Self {
            state: Mutex::new(State {
                queue: Vec::new(),
                computing: false,
                gathering,
            }),
            arrived: Condvar::new(),
            stats: Mutex::default(),
        }
    }

    pub fn stats(&self) -> BatchStats {
        *lock(&self.stats)
    }

    /// Callers whose rows are queued right now.
    pub fn queued(&self) -> usize {
        lock(&self.state).queue.len()
    }

    /// `f(rows)`, `rows` being `[n, ...]`, computed together with the rows of callers that arrive meanwhile (all
    /// concatenated along the first dimension). `f` must give `[n, ...]` for `[n, ...]`, each row from its input
    /// row alone. `caller` names who asks (a session), so that a batch can wait for the callers of the last ones.
    pub fn run(
        &self,
        caller: u64,
        rows: Tensor,
        f: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let answer = self.queue(caller, rows, Waiter::Thread(std::thread::current()));
        loop {
            match self.next(&answer) {
                Next::Answered(result) => return result,
                Next::Compute => self.compute_queue(&f),
                // Woken by our answer, or to compute when our rows missed the running batch (see `Computing`); an
                // unpark that comes before the park makes it return at once, so none is lost.
                Next::Wait => std::thread::park(),
            }
        }
    }

    /// [`RowBatcher::run`] for an async task: it waits for its answer without holding a thread, and only a caller
    /// that computes a batch (gathering included) runs synchronous code, through `blocking` (which must run the
    /// closure it is given on the calling thread without stalling the runtime, as tokio's `block_in_place` does).
    /// Sixteen sessions of one client then cost one thread hand-off a batch rather than sixteen each way.
    pub async fn run_async(
        &self,
        caller: u64,
        rows: Tensor,
        f: impl Fn(&Tensor) -> Result<Tensor>,
        blocking: impl Fn(&mut dyn FnMut()),
    ) -> Result<Tensor> {
        let woken = Arc::new(Notify::new());
        let answer = self.queue(caller, rows, Waiter::Task(woken.clone()));
        let _withdraw = Withdraw {
            batcher: self,
            answer: &answer,
        };
        loop {
            match self.next(&answer) {
                Next::Answered(result) => return result,
                Next::Compute => blocking(&mut || self.compute_queue(&f)),
                // A wake that comes before the wait leaves a permit, so none is lost.
                Next::Wait => woken.notified().await,
            }
        }
    }

    /// Queues a caller's rows; the returned slot gets its answer.
    fn queue(&self, caller: u64, rows: Tensor, waiter: Waiter) -> Slot {
        let answer = Arc::new(Answer {
            result: Mutex::new(None),
            waiter,
        });
        let mut state = lock(&self.state);
        state.queue.push(Request {
            caller,
            rows,
            answer: answer.clone(),
        });
        // The gathering caller waits for the whole set: waking it for each arrival would cost a context switch per
        // caller on the cores the others need to arrive.
        if state.computing && !state.gathering.missing(&state.queued_callers()) {
            self.arrived.notify_one();
        }
        answer
    }

    /// What a queued caller does next: take its answer, compute the queue (its rows are still in it, and nobody
    /// computes: the turn is now its own), or wait to be woken.
    fn next(&self, answer: &Slot) -> Next {
        let mut state = lock(&self.state);
        if let Some(done) = lock(&answer.result).take() {
            return Next::Answered(done);
        }
        if state.computing {
            return Next::Wait;
        }
        state.computing = true;
        Next::Compute
    }

    /// Gathers and computes the queue, the turn having been taken by [`RowBatcher::next`].
    fn compute_queue(&self, f: &impl Fn(&Tensor) -> Result<Tensor>) {
        let computing = Computing(self);
        let (batch, gathered) = self.gather(lock(&self.state));
        let took = self.compute(&batch, gathered, f);
        lock(&self.state)
            .gathering
            .ran(batch.iter().map(|r| r.caller).collect(), took);
        drop(computing);
    }

    /// Waits for the callers of the last two batches that have not queued, up to the gathering limit, then takes
    /// the queue (forgetting who was still missing); and whether it waited.
    fn gather(&self, mut state: MutexGuard<'_, State>) -> (Vec<Request>, bool) {
        let deadline = Instant::now() + state.gathering.limit();
        let mut waited = false;
        loop {
            let queued = state.queued_callers();
            if !state.gathering.missing(&queued) {
                break;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                state.gathering.forget_missing(&queued);
                break;
            };
            waited = true;
            state = self
                .arrived
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        (std::mem::take(&mut state.queue), waited)
    }

    /// Computes `batch` and answers each of its callers; returns how long it took.
    fn compute(
        &self,
        batch: &[Request],
        gathered: bool,
        f: &impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Duration {
        let started = Instant::now();
        let unanswered = Unanswered(batch);
        match batch {
            [] => {}
            [one] => answer_with(one, f(&one.rows)),
            many => {
                let inputs: Vec<&Tensor> = many.iter().map(|r| &r.rows).collect();
                let all = Tensor::cat(&inputs, 0)
                    .map_err(ModelError::from)
                    .and_then(|x| f(&x));
                let mut start = 0;
                match all {
                    Ok(all) => {
                        for r in many {
                            let n = r.rows.dims().first().copied().unwrap_or(0);
                            answer_with(r, all.narrow(0, start, n).map_err(ModelError::from));
                            start += n;
                        }
                    }
                    // Alone, each caller's rows fail (or not) on their own account.
                    Err(_) => many.iter().for_each(|r| answer_with(r, f(&r.rows))),
                }
            }
        }
        drop(unanswered);
        let took = started.elapsed();
        let mut stats = lock(&self.stats);
        stats.batches += 1;
        stats.calls += batch.len() as u64;
        stats.largest = stats.largest.max(batch.len());
        stats.gathered += u64::from(gathered);
        took
    }
}

fn answer_with(r: &Request, result: Result<Tensor>) {
    *lock(&r.answer.result) = Some(result);
    wake(&r.answer);
}

/// Wakes the caller waiting for `answer` (not a computing thread itself, which is not waiting; a computing task's
/// permit is taken by its next look at the answer).
fn wake(answer: &Answer) {
    match &answer.waiter {
        Waiter::Thread(t) if t.id() != std::thread::current().id() => t.unpark(),
        Waiter::Thread(_) => {}
        Waiter::Task(woken) => woken.notify_one(),
    }
}

/// Marks the batch's end when dropped, even if `f` panicked, and wakes the first caller whose rows are still
/// queued: it computes the next batch.
struct Computing<'a>(&'a RowBatcher);

impl Drop for Computing<'_> {
    fn drop(&mut self) {
        let next = {
            let mut state = lock(&self.0.state);
            state.computing = false;
            state.queue.first().map(|r| r.answer.clone())
        };
        if let Some(next) = next {
            wake(&next);
        }
    }
}

/// Takes an async caller's rows out of the queue if it is dropped before a batch took them (its request was
/// aborted), and then, if nobody computes, wakes the first caller still queued: the turn may have been passed to the
/// dropped caller, and rows nobody waits for would otherwise keep the others waiting for ever.
struct Withdraw<'a> {
    batcher: &'a RowBatcher,
    answer: &'a Slot,
}

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        let next = {
            let mut state = lock(&self.batcher.state);
            let before = state.queue.len();
            state.queue.retain(|r| !Arc::ptr_eq(&r.answer, self.answer));
            let withdrawn = state.queue.len() < before;
            if withdrawn && !state.computing {
                state.queue.first().map(|r| r.answer.clone())
            } else {
                None
            }
        };
        if let Some(next) = next {
            wake(&next);
        }
    }
}

/// Answers every request of a batch that has no answer yet with an error when dropped: if `f` panics, the
/// callers whose rows were taken do not wait for ever.
struct Unanswered<'a>(&'a [Request]);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        for r in self.0 {
            let mut slot = lock(&r.answer.result);
            if slot.is_none() {
                *slot = Some(Err(ModelError::Config(
                    "the batch these rows were in panicked".into(),
                )));
                drop(slot);
                wake(&r.answer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use std::sync::mpsc;

    fn row(v: f32) -> Tensor {
        Tensor::full(v, (1, 4), &Device::Cpu).unwrap()
    }

    /// `caller` computing a batch of its own row with `f`, holding the turn until the returned sender releases
    /// it: callers arriving meanwhile queue behind it.
    fn hold_turn<'scope>(
        s: &'scope std::thread::Scope<'scope, '_>,
        batcher: &'scope RowBatcher,
        caller: u64,
        f: fn(&Tensor) -> Result<Tensor>,
    ) -> (
        std::thread::ScopedJoinHandle<'scope, Result<Tensor>>,
        mpsc::Sender<()>,
    ) {
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let holder = s.spawn(move || {
            batcher.run(caller, row(caller as f32), |x| {
                started_tx.send(()).unwrap();
                release_rx.recv().unwrap();
                f(x)
            })
        });
        started_rx.recv().unwrap();
        (holder, release_tx)
    }

    /// A current-thread runtime with timers: async callers that parked its one thread would stall it.
    fn one_thread_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    /// Releases the running batch once `n` callers have queued their rows behind it.
    async fn release_when_queued(batcher: &RowBatcher, n: usize, release_tx: mpsc::Sender<()>) {
        while batcher.queued() < n {
            tokio::task::yield_now().await;
        }
        release_tx.send(()).unwrap();
    }

    #[test]
    fn callers_that_arrive_during_a_batch_share_the_next_and_each_gets_its_own_rows() {
        let batcher = RowBatcher::new();
        std::thread::scope(|s| {
            let (first, release_tx) = hold_turn(s, &batcher, 1, |x| Ok((x * 10.0)?));
            let others: Vec<_> = (2..=5)
                .map(|i| {
                    let batcher = &batcher;
                    s.spawn(move || batcher.run(i, row(i as f32), |x| Ok((x * 10.0)?)))
                })
                .collect();
            // Every other caller has queued its rows behind the running batch.
            while batcher.queued() < 4 {
                std::thread::yield_now();
            }
            release_tx.send(()).unwrap();
            let first = first.join().unwrap().unwrap();
            assert_eq!(first.to_vec2::<f32>().unwrap(), vec![vec![10.0; 4]]);
            for (i, t) in (2..=5).zip(others) {
                let got = t.join().unwrap().unwrap();
                assert_eq!(
                    got.to_vec2::<f32>().unwrap(),
                    vec![vec![10.0 * i as f32; 4]]
                );
            }
        });
        let stats = batcher.stats();
        assert_eq!((stats.batches, stats.calls, stats.largest), (2, 5, 4));
    }

    /// Async callers queued behind a thread's batch share the next batch, computed by the first of them, and wait
    /// without a thread: all four run on one runtime thread, which a caller holding it would deadlock.
    #[test]
    fn async_callers_share_a_batch_while_waiting_on_one_runtime_thread() {
        let batcher = RowBatcher::new();
        let runtime = one_thread_runtime();
        let computed_on = Mutex::new(vec![]);
        std::thread::scope(|s| {
            let (first, release_tx) = hold_turn(s, &batcher, 1, |x| Ok((x * 10.0)?));
            let got = runtime.block_on(async {
                let call = |i: u64| {
                    let (batcher, computed_on) = (&batcher, &computed_on);
                    async move {
                        let f = |x: &Tensor| Ok((x * 10.0)?);
                        let blocking = |job: &mut dyn FnMut()| {
                            lock(computed_on).push(i);
                            job()
                        };
                        batcher.run_async(i, row(i as f32), f, blocking).await
                    }
                };
                // Every task has queued its rows behind the running batch before it ends.
                let release = release_when_queued(&batcher, 4, release_tx);
                let all = async {
                    let (a, b, c, d, ()) =
                        tokio::join!(call(2), call(3), call(4), call(5), release);
                    [a, b, c, d]
                };
                // A lost wake-up fails here rather than hanging the suite.
                tokio::time::timeout(Duration::from_secs(60), all)
                    .await
                    .expect("the async callers stalled")
            });
            assert_eq!(
                first.join().unwrap().unwrap().to_vec2::<f32>().unwrap(),
                vec![vec![10.0; 4]]
            );
            for (i, t) in (2..=5).zip(got) {
                assert_eq!(
                    t.unwrap().to_vec2::<f32>().unwrap(),
                    vec![vec![10.0 * i as f32; 4]]
                );
            }
        });
        assert_eq!(lock(&computed_on).len(), 1, "one task computes for all");
        let stats = batcher.stats();
        assert_eq!((stats.batches, stats.calls, stats.largest), (2, 5, 4));
    }

    /// An async caller dropped while queued (its request aborted) leaves the queue: the caller behind it is woken to
    /// compute when the running batch ends, instead of the dropped one.
    #[test]
    fn an_async_caller_dropped_while_queued_does_not_strand_the_next() {
        let batcher = RowBatcher::new();
        let runtime = one_thread_runtime();
        std::thread::scope(|s| {
            let (first, release_tx) = hold_turn(s, &batcher, 1, |x| Ok(x.clone()));
            let got = runtime.block_on(async {
                let call = |i: u64| {
                    let batcher = &batcher;
                    async move {
                        let blocking = |job: &mut dyn FnMut()| job();
                        batcher
                            .run_async(i, row(i as f32), |x| Ok(x.clone()), blocking)
                            .await
                    }
                };
                // Its first poll queues caller 2's rows, first behind the running batch; then it is dropped.
                let dropped = tokio::time::timeout(Duration::from_millis(1), call(2)).await;
                assert!(
                    dropped.is_err(),
                    "caller 2 cannot finish behind the running batch"
                );
                let release = release_when_queued(&batcher, 1, release_tx);
                let (got, ()) = tokio::join!(
                    tokio::time::timeout(Duration::from_secs(60), call(3)),
                    release
                );
                got.expect("caller 3 was left waiting")
            });
            assert!(first.join().unwrap().is_ok());
            assert_eq!(got.unwrap().to_vec2::<f32>().unwrap(), vec![vec![3.0; 4]]);
        });
        assert_eq!(batcher.queued(), 0);
    }

    #[test]
    fn a_bad_caller_fails_alone_and_a_panic_reaches_only_its_batch() {
        let batcher = RowBatcher::new();
        // Rows that cannot be concatenated with the others' fail on their own.
        let bad = Tensor::zeros((1, 3), DType::F32, &Device::Cpu).unwrap();
        let check = |x: &Tensor| {
            if x.dim(1)? != 4 {
                return Err(ModelError::Config("wrong width".into()));
            }
            Ok(x.clone())
        };
        assert!(batcher.run(0, bad, check).is_err());
        assert!(batcher.run(0, row(2.0), check).is_ok());
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            batcher.run(0, row(3.0), |_| -> Result<Tensor> { panic!("boom") })
        }));
        assert!(panicked.is_err());
        // The batcher serves on after the panic.
        let after = batcher.run(0, row(4.0), check).unwrap();
        assert_eq!(after.to_vec2::<f32>().unwrap(), vec![vec![4.0; 4]]);
    }

    /// Callers 1 to 4 queued behind a running batch of caller 4, so that the next batch answers exactly these four.
    fn batch_of_four(batcher: &RowBatcher) {
        std::thread::scope(|s| {
            let (_holder, release_tx) = hold_turn(s, batcher, 4, |x| Ok(x.clone()));
            for i in 1..=4 {
                s.spawn(move || batcher.run(i, row(i as f32), |x| Ok(x.clone())));
            }
            while batcher.queued() < 4 {
                std::thread::yield_now();
            }
            release_tx.send(()).unwrap();
        });
        assert_eq!(batcher.stats().largest, 4);
    }

    /// After a batch of four, the first of them to come back waits for the three others, and they share its batch;
    /// a caller that stays alone waits once (up to the limit), then no more.
    #[test]
    fn the_caller_with_the_turn_waits_for_the_last_batchs_callers_once() {
        // No test machine reaches this limit: the four must meet whatever the delays between them.
        let batcher = RowBatcher::with_gather_limit(Duration::from_secs(60));
        batch_of_four(&batcher);
        let before = batcher.stats();
        std::thread::scope(|s| {
            let callers: Vec<_> = (1..=4)
                .map(|i| {
                    let batcher = &batcher;
                    let t = s.spawn(move || batcher.run(i, row(i as f32), |x| Ok((x * 2.0)?)));
                    std::thread::sleep(Duration::from_millis(20));
                    t
                })
                .collect();
            for (i, t) in (1..=4).zip(callers) {
                let got = t.join().unwrap().unwrap();
                assert_eq!(got.to_vec2::<f32>().unwrap(), vec![vec![2.0 * i as f32; 4]]);
            }
        });
        let after = batcher.stats();
        assert_eq!(after.batches - before.batches, 1, "{after:?}");
        assert_eq!(after.gathered - before.gathered, 1, "{after:?}");

        let batcher = RowBatcher::with_gather_limit(Duration::from_millis(100));
        batch_of_four(&batcher);
        let before = batcher.stats();
        for _ in 0..3 {
            batcher.run(1, row(1.0), |x| Ok(x.clone())).unwrap();
        }
        let after = batcher.stats();
        assert_eq!(
            (
                after.batches - before.batches,
                after.gathered - before.gathered
            ),
            (3, 1)
        );
    }
}

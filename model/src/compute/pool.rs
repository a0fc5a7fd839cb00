//! Where CPU compute runs: on a rayon pool, the one every kernel of a step (ours and candle's) parallelises over.
//!
//! A parallel op started from a thread outside the pool hands its work to the pool and sleeps on a lock until it
//! is done: two context switches per op, some 150 ops per decode step. Started from a thread of the pool, the same
//! op runs part of its work on that thread and the pool's other threads take the rest. So a whole forward is
//! handed to the pool once, and its ops run from inside it: to rayon's shared pool ([`on_compute_pool`]), or, from
//! a span scheduler's thread, to that thread's own pool, of which it is a worker ([`OwnPool`]: no hand-off at all).
//!
//! The pool's other threads are kept looking for work while the forward runs ([`keep_awake`]; a thread that finds
//! none for [`IDLE_SPIN`], longer than a forward's serial steps, stops looking): left to
//! themselves they fall asleep between ops after a few dozen yields, and on a virtual machine a sleeping thread
//! takes longer to wake than many of a step's ops take to run: the thread that started an op then ran all of it
//! while the other woke up, only to fall asleep again (a profile of sixteen sessions on two cores: one core idle
//! a fifth of the batch). For the same reason a span scheduler's pool is woken as a step is queued
//! ([`PoolWaker`]), so that its threads wake while the scheduler's own does rather than after it.
use candle_core::Device;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long a thread kept awake by [`keep_awake`] looks for work before it gives up: longer than the serial steps
/// between a forward's parallel ops (a norm, a session's attention set-up: tens of microseconds), short enough
/// that a thread holding up the forward's own work by waiting there (see `keep_awake`) costs it little.
const IDLE_SPIN: Duration = Duration::from_micros(200);

/// How long threads woken by [`PoolWaker::wake`] look for the coming forward before they go back to sleep: longer
/// than the owner thread takes to wake and start it (a wake-up and a batch's set-up, some 100 us on a virtual
/// machine), short enough to cost little when a batch waits for more sessions first.
const WAKE_SPIN: Duration = Duration::from_micros(400);

/// Sets `RAYON_NUM_THREADS`, when it is unset, to the number rayon picks by itself (one thread per CPU this
/// process may use), so that every pool is as big as before and candle stops counting CPUs on each matmul.
///
/// Why: candle asks for its thread count on every CPU matmul and, without the variable, counts physical cores
/// by reading and parsing `/proc/cpuinfo` each time: a decode step's attention matmul took 15 us instead of 0.4 on
/// a 2-vCPU VM. A decode step through a KV cache that takes candle's attention (f32, Petal's default) makes two
/// such matmuls per block: 60 reads a token for SmolLM2, local decoding 30% slower. Binaries call this first
/// thing in `main`; a library embedding Petal sets the variable itself.
///
/// Call it before any other thread of the process exists: changing the environment while another thread reads it
/// is undefined behaviour in libc.
pub fn pin_thread_count() {
    set_unless_set("RAYON_NUM_THREADS", || {
        std::thread::available_parallelism()
            .ok()
            .map(|n| n.to_string())
    });
}

/// Sets `CANDLE_NUM_THREADS` to 1, when it is unset, so that candle's quantized CPU matmuls run on the thread that
/// calls them, with no pool of candle's own; [`CandleRows`](super::linear::CandleRows) spreads them over ours.
///
/// Why: formats our kernels do not take (the K-quants: Q4_K, Q6_K, ...) go through candle's matmul, which runs on a
/// pool of its own whose workers spin after each matmul, on the cores our pool's threads need for the ops between
/// (SmolLM2 as llama.cpp's Q4_K_M has a Q4_K or Q6_K matrix in each block; on 2 vCPUs local decoding ran at 158
/// tokens/s with that pool, 240 with its workers not spinning). Binaries call this first thing in `main`, as
/// [`pin_thread_count`], with the same care: no other thread may exist yet.
pub fn keep_candle_on_our_threads() {
    set_unless_set("CANDLE_NUM_THREADS", || Some("1".into()));
}

/// Sets the environment variable `name` to `value()` (when that gives one) unless the user set it already.
fn set_unless_set(name: &str, value: impl FnOnce() -> Option<String>) {
    if std::env::var_os(name).is_none() {
        if let Some(value) = value() {
            std::env::set_var(name, value);
        }
    }
}

/// Runs `f` on a thread of the compute pool when `device` is the CPU (inline when already on one, and on other
/// devices, whose kernels do not use the pool).
pub fn on_compute_pool<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        awake_scope(f)
    } else {
        f()
    }
}

/// A compute pool whose first worker is the thread that made it (a span scheduler's): a forward that thread
/// starts runs there at once, where [`on_compute_pool`] hands it to the shared pool and sleeps until it is done,
/// two thread wake-ups per batch (some 50 us each on a virtual machine, on every hop of a chain). Kernels called
/// inside take this pool's threads (rayon's calls use the pool of the thread they run on).
pub struct OwnPool {
    /// The pool and what it shares with its wakers; `None` off the CPU, or when the pool could not start:
    /// forwards then go through [`on_compute_pool`].
    pool: Option<(Arc<rayon::ThreadPool>, Arc<PoolState>)>,
}

/// What an [`OwnPool`] shares with its [`PoolWaker`]s.
struct PoolState {
    /// A forward runs ([`OwnPool::run`]): its own [`keep_awake`] keeps the other threads at work.
    running: AtomicBool,
    /// When the last wake was sent, in nanoseconds since `epoch` (0: never), so that a burst of steps sends one.
    last_wake: AtomicU64,
    epoch: Instant,
}

impl Default for PoolState {
    fn default() -> Self {
        Self {
            running: AtomicBool::new(false),
            last_wake: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl OwnPool {
    /// A pool of as many threads as the shared one (`RAYON_NUM_THREADS`, or one per CPU), the calling thread
    /// included, when `device` is the CPU.
    pub fn on_this_thread(device: &Device, name: &str) -> Self {
        if !device.is_cpu() || rayon::current_thread_index().is_some() {
            return Self { pool: None };
        }
        let prefix = name.to_string();
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(move |i| format!("{prefix}-{i}"))
            .use_current_thread()
            .build();
        match pool {
            Ok(pool) => Self {
                pool: Some((Arc::new(pool), Arc::default())),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a compute pool; the shared one serves instead");
                Self { pool: None }
            }
        }
    }

    /// Runs `f` on this thread, the pool's other threads kept looking for its work until it returns.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            // On a thread of the pool, a scope runs its body right here.
            Some((_, state)) => {
                state.running.store(true, Ordering::Release);
                let _running = SetOnDrop(&state.running, false);
                awake_scope(f)
            }
            None => f(),
        }
    }

    /// A handle other threads use to wake this pool's threads ahead of a forward; `None` for a pool that is not
    /// this thread's own (off the CPU), where there is nothing to wake.
    pub fn waker(&self) -> Option<PoolWaker> {
        self.pool.as_ref().map(|(pool, state)| PoolWaker {
            pool: Arc::downgrade(pool),
            state: state.clone(),
        })
    }
}

/// Wakes the threads of an [`OwnPool`] other than its owner when a forward is about to start there, so that they
/// wake while the owner does rather than after it: a step handed to a span scheduler otherwise wakes its thread,
/// whose forward then wakes the others, and the forward's first ops wait for the second wake-up (on a virtual
/// machine some 50 us, on every hop of a chain).
#[derive(Clone)]
pub struct PoolWaker {
    /// Weak: the pool belongs to its owner thread, which drops it when it ends.
    pool: Weak<rayon::ThreadPool>,
    state: Arc<PoolState>,
}

impl PoolWaker {
    /// Wakes the pool's other threads to look for work for up to [`WAKE_SPIN`], unless a forward is running (its
    /// threads are awake), a wake was sent less than that ago, or the pool is gone. Returns whether it sent one.
    pub fn wake(&self) -> bool {
        let now = self.state.epoch.elapsed().as_nanos();
        self.wake_at(u64::try_from(now).unwrap_or(u64::MAX))
    }

    /// [`PoolWaker::wake`] at `now` nanoseconds after the pool's epoch.
    fn wake_at(&self, now: u64) -> bool {
        let state = &self.state;
        if state.running.load(Ordering::Acquire) {
            return false;
        }
        let last = state.last_wake.load(Ordering::Relaxed);
        let spin = u64::try_from(WAKE_SPIN.as_nanos()).unwrap_or(u64::MAX);
        if last != 0 && now.saturating_sub(last) < spin {
            return false;
        }
        if state
            .last_wake
            .compare_exchange(last, now.max(1), Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            // Another caller sent this wake.
            return false;
        }
        let Some(pool) = self.pool.upgrade() else {
            return false;
        };
        let state = state.clone();
        pool.spawn_broadcast(move |ctx| {
            // Index 0 is the owner, which runs this job only once it computes: nothing to wait for then.
            if ctx.index() != 0 {
                look_for_work_until_a_forward(&state);
            }
        });
        true
    }
}

/// Looks for work until it has run some (the forward's own [`keep_awake`] job: the thread is then at work), a
/// forward runs, or [`WAKE_SPIN`] passes. Returns at once when a forward already runs: this job may have been taken
/// inside it, by a thread waiting in a join that cannot end before the job does.
fn look_for_work_until_a_forward(state: &PoolState) {
    let started = Instant::now();
    while !state.running.load(Ordering::Acquire) && started.elapsed() < WAKE_SPIN {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            return;
        }
        std::thread::yield_now();
    }
}

/// `f` in a rayon scope (of the shared pool when called from outside it, right here on a thread of a pool), with
/// [`keep_awake`].
fn awake_scope<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    rayon::scope(|scope| keep_awake(scope, &done, f))
}

/// Runs `f` on this thread of the pool while every other thread of the pool looks for work (running any it
/// finds) instead of sleeping, until `f` returns and sets `done`, or it has found nothing for [`IDLE_SPIN`].
/// Work they find may be another region's (two spans in one process): it runs to its end before that thread
/// checks `done` again, so the two regions finish together, as they would if that thread had been asleep and
/// taken the other region's work on waking.
fn keep_awake<'s, R>(scope: &rayon::Scope<'s>, done: &'s AtomicBool, f: impl FnOnce() -> R) -> R {
    let owner = rayon::current_thread_index();
    scope.spawn_broadcast(move |_, ctx| {
        // This thread runs `f`: waiting here would keep it from ever returning.
        if Some(ctx.index()) == owner {
            return;
        }
        // This job may also have been taken by a thread waiting inside the region's own work (a join whose other
        // half another thread took), and that work cannot finish until the job returns: so it returns once it has
        // found nothing to do for a while, as an idle thread would fall asleep, only later.
        let mut idle_since = None;
        while !done.load(Ordering::Acquire) {
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now.duration_since(*idle_since.get_or_insert(now)) > IDLE_SPIN {
                return;
            }
            std::thread::yield_now();
        }
    });
    // Set however `f` ends: a panic leaves through the scope, which first waits for the jobs above.
    let _done = SetOnDrop(done, true);
    f()
}

/// Sets its flag to its value when dropped.
struct SetOnDrop<'a>(&'a AtomicBool, bool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(self.1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::{look_for_work_until_a_forward, on_compute_pool, OwnPool, PoolState, WAKE_SPIN};
    use candle_core::Device;
    use rayon::prelude::*;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn a_pool_woken_ahead_computes_its_forward_and_a_burst_of_steps_sends_one_wake() {
        std::thread::spawn(|| {
            let pool = OwnPool::on_this_thread(&Device::Cpu, "test");
            let waker = pool.waker().expect("a CPU pool of its own has a waker");
            let spin = WAKE_SPIN.as_nanos() as u64;
            let mut now = 1;
            for _ in 0..50 {
                // Sent from another thread, as a span scheduler's handle does.
                let (first, second) = std::thread::scope(|s| {
                    s.spawn(|| (waker.wake_at(now), waker.wake_at(now + spin / 2)))
                        .join()
                        .unwrap()
                });
                assert!(first, "the first wake of a burst is sent");
                assert!(!second, "a second wake within the first's spin is not");
                let sum = pool.run(|| {
                    // The forward runs: its own threads are awake, nothing to send.
                    assert!(!waker.wake_at(now + 2 * spin));
                    (0..20_000u64).into_par_iter().sum::<u64>()
                });
                assert_eq!(sum, (0..20_000u64).sum::<u64>());
                now += spin;
            }
            drop(pool);
            assert!(
                !waker.wake_at(now + spin),
                "a pool that is gone is not woken"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_woken_thread_stops_looking_for_work_when_a_forward_runs_or_its_time_is_up() {
        let state = PoolState::default();
        state.running.store(true, Ordering::Release);
        // Taken inside a forward (by a thread waiting in a join), it must return at once to let the join end.
        let started = Instant::now();
        look_for_work_until_a_forward(&state);
        assert!(started.elapsed() < WAKE_SPIN);
        state.running.store(false, Ordering::Release);
        let started = Instant::now();
        look_for_work_until_a_forward(&state);
        assert!(started.elapsed() >= WAKE_SPIN);
    }

    #[test]
    fn regions_started_from_many_threads_at_once_all_finish_with_their_results() {
        // The regions overlap: each keeps the pool's threads busy looking for work, and those threads run the
        // other regions' work meanwhile; every region must still end, with its own result.
        let sum = |i: u64| (0..20_000u64).into_par_iter().map(|x| x * i).sum::<u64>();
        let threads: Vec<_> = (0..6u64)
            .map(|i| {
                std::thread::spawn(move || {
                    (0..20)
                        .map(|_| {
                            on_compute_pool(&Device::Cpu, || {
                                sum(i) + on_compute_pool(&Device::Cpu, || sum(1))
                            })
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let base = (0..20_000u64).sum::<u64>();
        for (i, thread) in threads.into_iter().enumerate() {
            let sums = thread.join().unwrap();
            assert!(
                sums.iter().all(|&s| s == base * i as u64 + base),
                "region {i}: {sums:?}"
            );
        }
    }

    #[test]
    fn regions_beside_work_started_outside_any_region_do_not_wait_on_each_other() {
        // A region's spinning job can be taken by a thread in the middle of the region's own work (waiting inside
        // a join for a half another thread took): it must not wait there for the region to end. Work injected
        // from outside the pool (candle's ops, called from another thread) makes that likely.
        let (finished_tx, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let nested = |i: u64| {
                (0..64u64)
                    .into_par_iter()
                    .map(|j| (0..256u64).into_par_iter().map(|k| k ^ j ^ i).sum::<u64>())
                    .sum::<u64>()
            };
            let outside = std::thread::spawn(move || (0..3000).map(nested).sum::<u64>());
            let regions: u64 = (0..3000)
                .map(|i| on_compute_pool(&Device::Cpu, || nested(i)))
                .sum();
            let _ = finished_tx.send(regions == outside.join().unwrap());
        });
        let same = finished.recv_timeout(std::time::Duration::from_secs(60));
        assert_eq!(
            same,
            Ok(true),
            "the regions and the outside work did not both finish"
        );
    }

    #[test]
    fn a_panicking_forward_reaches_its_caller_and_the_pools_serve_on() {
        // The other threads wait for the forward to end: a panic must end it too.
        let panicked = std::panic::catch_unwind(|| {
            on_compute_pool(&Device::Cpu, || -> u64 { panic!("a forward failed") })
        });
        assert!(panicked.is_err());
        assert_eq!(
            on_compute_pool(&Device::Cpu, || (0..100u64).into_par_iter().sum::<u64>()),
            4950
        );
        std::thread::spawn(|| {
            let pool = OwnPool::on_this_thread(&Device::Cpu, "test");
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run(|| -> u64 { panic!("a forward failed") })
            }));
            assert!(panicked.is_err());
            assert_eq!(pool.run(|| (0..100u64).into_par_iter().sum::<u64>()), 4950);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_owning_a_pool_computes_there() {
        std::thread::spawn(|| {
            let pool = OwnPool::on_this_thread(&Device::Cpu, "test");
            let here = std::thread::current().id();
            let (ran_on, sum) = pool.run(|| {
                let sum = (0..20_000u64).into_par_iter().map(|x| x * 3).sum::<u64>();
                (std::thread::current().id(), sum)
            });
            assert_eq!((ran_on, sum), (here, 3 * (0..20_000u64).sum::<u64>()));
            // A forward started on this thread outside `run` runs here too.
            assert_eq!(
                on_compute_pool(&Device::Cpu, || std::thread::current().id()),
                here
            );
        })
        .join()
        .unwrap();
    }
}

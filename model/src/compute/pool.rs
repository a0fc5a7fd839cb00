//! Where CPU compute runs: on rayon's pool, the one every kernel of a step (ours and candle's) parallelises over.
//!
//! A parallel op started from a thread outside the pool hands its work to the pool and sleeps on a lock until it
//! is done: two context switches per op, some 150 ops per decode step. Started from a thread of the pool, the same
//! op runs part of its work on that thread and the pool's other threads take the rest. So a whole forward is
//! handed to the pool once, and its ops run from inside it.
//!
//! The pool's other threads are kept looking for work for as long as the forward runs ([`keep_awake`]): left to
//! themselves they fall asleep between ops after a few dozen yields, and on a virtual machine a sleeping thread
//! takes longer to wake than many of a step's ops take to run: the thread that started an op then ran all of it
//! while the other woke up, only to fall asleep again (a profile of sixteen sessions on two cores: one core idle
//! a fifth of the batch).
use candle_core::Device;
use std::sync::atomic::{AtomicBool, Ordering};

/// Runs `f` on a thread of the compute pool when `device` is the CPU (inline when already on one, and on other
/// devices, whose kernels do not use the pool).
pub fn on_compute_pool<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        let done = AtomicBool::new(false);
        rayon::scope(|scope| keep_awake(scope, &done, f))
    } else {
        f()
    }
}

/// Runs `f` on this thread of the pool while every other thread of the pool looks for work (running any it
/// finds) instead of sleeping, until `f` returns and sets `done`. Work they find may be another region's (two
/// spans in one process): it runs to its end before that thread checks `done` again, so the two regions finish
/// together, as they would if that thread had been asleep and taken the other region's work on waking.
fn keep_awake<'s, R>(scope: &rayon::Scope<'s>, done: &'s AtomicBool, f: impl FnOnce() -> R) -> R {
    let owner = rayon::current_thread_index();
    scope.spawn_broadcast(move |_, ctx| {
        // This thread runs `f`: waiting here would keep it from ever returning.
        if Some(ctx.index()) == owner {
            return;
        }
        while !done.load(Ordering::Acquire) {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::thread::yield_now();
            }
        }
    });
    let result = f();
    done.store(true, Ordering::Release);
    result
}

#[cfg(test)]
mod tests {
    use super::on_compute_pool;
    use candle_core::Device;
    use rayon::prelude::*;

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
}

//! Where CPU compute runs: on rayon's pool, the one every kernel of a step (ours and candle's) parallelises over.
//!
//! A parallel op started from a thread outside the pool hands its work to the pool and sleeps on a lock until it
//! is done: two context switches per op, some 150 ops per decode step. Started from a thread of the pool, the same
//! op runs part of its work on that thread and the pool's other threads, still spinning from the previous op, take
//! the rest. So a whole forward is handed to the pool once, and its ops run from inside it.
use candle_core::Device;

/// Runs `f` on a thread of the compute pool when `device` is the CPU (inline when already on one, and on other
/// devices, whose kernels do not use the pool).
pub fn on_compute_pool<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        rayon::scope(|_| f())
    } else {
        f()
    }
}

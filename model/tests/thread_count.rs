//! `pool::pin_thread_count`, alone in its test binary: it changes the process's environment, which no other
//! thread may read meanwhile. (What it saves, candle's read of /proc/cpuinfo on every CPU matmul, is measured by
//! `petal-bench`, not timed here.)
use petal_model::compute::pool::pin_thread_count;

#[test]
fn pins_rayons_own_count_and_keeps_a_count_the_user_chose() {
    // This test is the binary's only one, so no other thread reads the environment while it changes.
    std::env::remove_var("RAYON_NUM_THREADS");
    pin_thread_count();
    let rayons_own = std::thread::available_parallelism().unwrap().to_string();
    assert_eq!(std::env::var("RAYON_NUM_THREADS").unwrap(), rayons_own);
    // What rayon would have picked by itself: the pools keep their size.
    assert_eq!(rayon::current_num_threads().to_string(), rayons_own);

    std::env::set_var("RAYON_NUM_THREADS", "3");
    pin_thread_count();
    assert_eq!(std::env::var("RAYON_NUM_THREADS").unwrap(), "3");
}

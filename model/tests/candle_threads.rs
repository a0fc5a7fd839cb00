//! `pool::keep_candle_on_our_threads`, alone in its test binary: it changes the process's environment, which no
//! other thread may read meanwhile. (What it saves, candle's pool beside ours, is measured by `petal-bench`, not
//! timed here.)
use petal_model::compute::pool::keep_candle_on_our_threads;

#[test]
fn keeps_candle_on_the_calling_thread_unless_the_user_chose() {
    // This test is the binary's only one, so no other thread reads the environment while it changes.
    std::env::remove_var("CANDLE_NUM_THREADS");
    keep_candle_on_our_threads();
    assert_eq!(std::env::var("CANDLE_NUM_THREADS").as_deref(), Ok("1"));

    std::env::set_var("CANDLE_NUM_THREADS", "4");
    keep_candle_on_our_threads();
    assert_eq!(std::env::var("CANDLE_NUM_THREADS").as_deref(), Ok("4"));
}

//! `pool::stop_candle_pool_spin`, alone in its test binary: it changes the process's environment, which no other
//! thread may read meanwhile. (What it saves, candle's matmul workers spinning on the cores a span's pool needs, is
//! measured by `petal-bench`, not timed here.)
use petal_model::compute::pool::stop_candle_pool_spin;

#[test]
fn stops_the_spin_and_keeps_a_limit_the_user_chose() {
    // This test is the binary's only one, so no other thread reads the environment while it changes.
    std::env::remove_var("CANDLE_BARRIER_POOL_SPIN_LIMIT");
    stop_candle_pool_spin();
    assert_eq!(
        std::env::var("CANDLE_BARRIER_POOL_SPIN_LIMIT").as_deref(),
        Ok("0")
    );

    std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "1000");
    stop_candle_pool_spin();
    assert_eq!(
        std::env::var("CANDLE_BARRIER_POOL_SPIN_LIMIT").as_deref(),
        Ok("1000")
    );
}

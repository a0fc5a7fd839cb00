//! Lanes of a CPU batch: its sessions split into groups that each go through the whole span on their own thread,
//! rather than every op of one forward split across all the pool's threads.
//!
//! A forward of sixteen decode rows through SmolLM2's 30 blocks is some 300 parallel regions (matmuls, their
//! activations' quantizing, attention over the sessions), each a fork and a join of the pool's threads. On a
//! 2-vCPU virtual machine its matmuls ran 1.17-1.29x faster as two independent streams of eight rows, one per
//! thread, than as one stream of sixteen split op by op. A lane's rows still share each matmul (one pass over a
//! weight block for all of them), and a thread whose lane ends first takes work from the other's ops. A lane needs
//! rows: with four or fewer, each lane's own pass over the weights costs more than the joins it saves.
//!
//! A row's result does not depend on the rows beside it (every kernel gives a tile's rows the same result bit for
//! bit, and attention is per session), so how a batch is split changes no output.

/// Rows each of the pool's threads needs before a batch goes in lanes, one a thread. Measured on a 2-vCPU Emerald
/// Rapids-class Xeon (AVX-512 VNNI, no AMX exposed): SmolLM2's 120 block matmuls as two streams of `m / 2` rows,
/// one per thread, against one stream of `m` rows on both threads: `m` = 32 1.27x, 16 1.17-1.29x, 12 1.12x faster;
/// 8 and 6 level (0.99x, 0.97x); 4 and 2 0.79x and 0.81x. The whole node (`petal-bench compare`, f16 cache), eight
/// sessions in two lanes of four against one batch: 7.5-8.2 ms a batch against 7.4; twelve in two lanes of six:
/// 9.5-10.3 against 10.4-10.6.
pub(crate) const MIN_ROWS: usize = 6;

/// How many lanes a batch of `rows` rows in `sessions` sessions takes on a pool of `threads` threads: one per
/// thread (at most one per session: a session's rows share its cache) once there are [`MIN_ROWS`] rows for each
/// thread, else one. Each lane then has a thread and at least the rows measured to gain; with fewer rows a thread,
/// each lane's pass over the weights would be shared by too few rows (untested beyond two threads, so not risked).
pub(crate) fn count(rows: usize, sessions: usize, threads: usize) -> usize {
    if threads >= 2 && rows >= MIN_ROWS * threads {
        threads.min(sessions).max(1)
    } else {
        1
    }
}

/// Where to cut steps of `rows` rows each so that the first part, for `first` of `lanes` lanes, holds the nearest
/// to its share of the rows: an index in `1..rows.len()` (both parts have a step), or 0 with fewer than two steps.
pub(crate) fn cut(rows: &[usize], first: usize, lanes: usize) -> usize {
    if rows.len() < 2 {
        return 0;
    }
    let total: usize = rows.iter().sum();
    // Compared as `rows * lanes` against `total * first`: no rounding.
    let target = total * first;
    let mut before = 0;
    for (i, &r) in rows.iter().enumerate() {
        let after = before + r;
        if after * lanes >= target {
            // The nearer of cutting before step `i` and after it.
            let (under, over) = (target - before * lanes, after * lanes - target);
            let at = if under <= over { i } else { i + 1 };
            return at.clamp(1, rows.len() - 1);
        }
        before = after;
    }
    rows.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_need_threads_sessions_and_rows() {
        assert_eq!(count(16, 16, 2), 2);
        assert_eq!(count(12, 12, 2), 2);
        assert_eq!(count(11, 11, 2), 1, "six rows a thread at least");
        assert_eq!(count(16, 16, 16), 1, "six rows a thread at least");
        assert_eq!(count(96, 96, 16), 16);
        assert_eq!(count(400, 4, 16), 4, "one lane a session at most");
        assert_eq!(count(512, 1, 8), 1, "one session's rows stay together");
        assert_eq!(count(64, 16, 1), 1);
        assert_eq!(count(0, 0, 4), 1);
    }

    #[test]
    fn cuts_balance_rows_and_leave_a_step_on_each_side() {
        assert_eq!(cut(&[1; 16], 1, 2), 8);
        assert_eq!(cut(&[1; 15], 1, 2), 7);
        assert_eq!(cut(&[1; 16], 1, 3), 5);
        // A prefill beside decode steps: it goes alone.
        assert_eq!(cut(&[512, 1, 1, 1], 1, 2), 1);
        assert_eq!(cut(&[1, 1, 1, 512], 1, 2), 3);
        assert_eq!(cut(&[1, 512], 1, 2), 1);
        assert_eq!(cut(&[7], 1, 2), 0);
        assert_eq!(cut(&[4, 4, 8], 1, 2), 2);
    }
}

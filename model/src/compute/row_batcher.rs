//! One computation for the rows of concurrent callers: the LM head of every session of a client that reaches it at
//! the same time runs as one matmul, which reads the head's weights once instead of once per session.
//!
//! There is no thread of its own (a lone caller pays no hand-off): each caller queues its rows and takes the
//! compute turn; whoever gets the turn with its own rows still unanswered computes everything queued at that
//! moment, its own rows included, and answers the others, who find their answer when their turn comes. A caller
//! waits for at most the batch running when it arrived, plus its own.
//!
//! The function must compute each row independently of the others (ours do: activations are quantized by row and
//! every output element is one row's dot product), so a batched answer is the unbatched one, bit for bit. If the
//! batch fails, each caller's rows are computed again alone, so an error reaches only the rows that cause it.
use crate::error::{ModelError, Result};
use candle_core::Tensor;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// A caller's answer, filled by whoever computes its rows.
type Slot = Arc<Mutex<Option<Result<Tensor>>>>;

struct Request {
    rows: Tensor,
    answer: Slot,
}

/// Batches concurrent calls of one row-wise computation; see the module docs.
#[derive(Default)]
pub struct RowBatcher {
    queue: Mutex<Vec<Request>>,
    turn: Mutex<()>,
    stats: Mutex<BatchStats>,
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
}

/// Locks `m`, whatever a panicking holder left behind: the data stays consistent (a request is either queued or
/// answered, see [`Unanswered`]).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RowBatcher {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn stats(&self) -> BatchStats {
        *lock(&self.stats)
    }

    /// Callers waiting for their turn right now.
    pub fn queued(&self) -> usize {
        lock(&self.queue).len()
    }

    /// `f(rows)`, `rows` being `[n, ...]`, computed together with the rows of callers that arrive meanwhile (all
    /// concatenated along the first dimension). `f` must give `[n, ...]` for `[n, ...]`, each row from its input
    /// row alone.
    pub fn run(&self, rows: Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let answer: Slot = Arc::default();
        lock(&self.queue).push(Request {
            rows,
            answer: answer.clone(),
        });
        let _turn = lock(&self.turn);
        if let Some(done) = lock(&answer).take() {
            return done;
        }
        // Our rows are still queued: nobody who held the turn since took them.
        let batch = std::mem::take(&mut *lock(&self.queue));
        let unanswered = Unanswered(&batch);
        match batch.as_slice() {
            [one] => answer_with(one, f(&one.rows)),
            many => {
                let inputs: Vec<&Tensor> = many.iter().map(|r| &r.rows).collect();
                match Tensor::cat(&inputs, 0)
                    .map_err(ModelError::from)
                    .and_then(|x| f(&x))
                {
                    Ok(all) => {
                        let mut start = 0;
                        for r in many {
                            let n = r.rows.dim(0)?;
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
        let mut stats = lock(&self.stats);
        stats.batches += 1;
        stats.calls += batch.len() as u64;
        stats.largest = stats.largest.max(batch.len());
        drop(stats);
        let mine = lock(&answer).take();
        mine.unwrap_or_else(|| {
            Err(ModelError::Config(
                "the batched computation answered nothing".into(),
            ))
        })
    }
}

fn answer_with(r: &Request, result: Result<Tensor>) {
    *lock(&r.answer) = Some(result);
}

/// Answers every request of a batch that has no answer yet with an error when dropped: if `f` panics, the
/// callers whose rows were taken do not wait for ever, and each finds an answer when its turn comes.
struct Unanswered<'a>(&'a [Request]);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        for r in self.0 {
            let mut slot = lock(&r.answer);
            if slot.is_none() {
                *slot = Some(Err(ModelError::Config(
                    "the batch these rows were in panicked".into(),
                )));
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

    #[test]
    fn callers_that_arrive_during_a_batch_share_the_next_and_each_gets_its_own_rows() {
        let batcher = Arc::new(RowBatcher::new());
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Mutex::new(release_rx);
        std::thread::scope(|s| {
            // The first caller holds the turn until released.
            let first = s.spawn(|| {
                batcher.run(row(1.0), |x| {
                    started_tx.send(()).unwrap();
                    lock(&release_rx).recv().unwrap();
                    Ok((x * 10.0)?)
                })
            });
            started_rx.recv().unwrap();
            let others: Vec<_> = (2..=5)
                .map(|i| {
                    let batcher = &batcher;
                    s.spawn(move || batcher.run(row(i as f32), |x| Ok((x * 10.0)?)))
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
        assert!(batcher.run(bad, check).is_err());
        assert!(batcher.run(row(2.0), check).is_ok());
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            batcher.run(row(3.0), |_| -> Result<Tensor> { panic!("boom") })
        }));
        assert!(panicked.is_err());
        // The batcher serves on after the panic.
        let after = batcher.run(row(4.0), check).unwrap();
        assert_eq!(after.to_vec2::<f32>().unwrap(), vec![vec![4.0; 4]]);
    }
}

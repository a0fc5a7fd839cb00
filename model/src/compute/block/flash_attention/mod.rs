//! Attention of a step's query rows against an f16 (or f32) KV cache on the CPU, read in place (flash attention).
//!
//! A decode step has one query row per head, and its cost is reading the cache: candle's path widens an f16 cache
//! to f32 (a copy of the whole context per block and step), runs two small matmuls per KV head and a softmax, each
//! op on its own and each waking the threads. A prompt's cost is the `T x T` scores: candle's path builds them per
//! chunk of queries, over keys no query of the chunk may see, with a mask as large as the scores.
//! Here the queries of a KV head's group are taken in tiles of at most [`MAX_ROWS`] rows, and each tile reads the
//! keys and values it may see (causal, windowed) once, in chunks of positions, with an online softmax (running
//! maximum, sum and weighted values) merged chunk by chunk: memory stays `rows x chunk` per task, nothing is
//! masked, and the cache is never copied. A decode step (one tile) spreads its chunks over the threads
//! (flash-decoding); a prompt (many tiles) gives each thread whole tiles.
use rayon::prelude::*;
use std::cell::RefCell;
use std::ops::Range;
use vector::{
    axpy, dots, dots_rows, exp_shifted, max, sum, weighted_sum, weighted_sums, SHARED_ROWS,
};

mod cache;
mod candle_op;
mod vector;

pub(crate) use cache::Cache;

/// Keys scored at once: big enough to amortise a task, small enough to spread a 2k context over the threads
/// and keep a tile's scores and widened keys in L2.
const KEYS_PER_CHUNK: usize = 256;
/// Below this many keys over all KV heads, the step is computed on the calling thread: waking the pool would
/// cost more than the work.
const PARALLEL_KEYS: usize = 2048;
/// Most query rows (group x tokens) of one tile: the rows that share each widened chunk of keys.
const MAX_ROWS: usize = 64;
/// With at least this many tiles over all KV heads, every task is a whole tile (its chunks one after another);
/// with fewer, the chunks of each tile are tasks of their own, so a decode step still uses every thread.
const TILES_FOR_WHOLE_TILE_TASKS: usize = 16;

/// `softmax(scale * q k^T [softcapped, masked]) v` for queries `[batch, kv_heads, group, tokens, head_dim]`
/// (contiguous) at positions `position..position + tokens`, keys and values `[batch, kv_heads, len, head_dim]`
/// with contiguous rows (a view into the cache's buffers). Output: the queries' shape.
#[derive(Debug, Clone)]
pub(crate) struct FlashAttention {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
    pub position: usize,
    pub group: usize,
    /// Each query head's sink logit (gpt-oss), which joins its softmax with no value.
    pub sinks: Option<std::sync::Arc<[f32]>>,
}

/// A partial result for every query row of a tile: running maximum, sum of exponentials, and the values weighted
/// by those exponentials.
#[derive(Default)]
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl Partial {
    /// `rows` rows of head size `d` that have seen no key yet, in this partial's buffers.
    fn reset(&mut self, rows: usize, d: usize) {
        self.max.clear();
        self.max.resize(rows, f32::NEG_INFINITY);
        self.sum.clear();
        self.sum.resize(rows, 0.0);
        self.acc.clear();
        self.acc.resize(rows * d, 0.0);
    }

    fn empty(rows: usize, d: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
            acc: vec![0.0; rows * d],
        }
    }

    /// Folds `other` (the same rows, other keys) into `self`, both rescaled to their common maximum.
    fn merge(&mut self, other: &Partial) {
        let d = self.acc.len() / self.max.len().max(1);
        for r in 0..self.max.len() {
            if other.sum[r] == 0.0 {
                continue;
            }
            let max = self.max[r].max(other.max[r]);
            let (mine, theirs) = ((self.max[r] - max).exp(), (other.max[r] - max).exp());
            self.sum[r] = self.sum[r] * mine + other.sum[r] * theirs;
            let acc = &mut self.acc[r * d..(r + 1) * d];
            acc.iter_mut().for_each(|x| *x *= mine);
            axpy(theirs, &other.acc[r * d..(r + 1) * d], acc);
            self.max[r] = max;
        }
    }
}

/// The buffers a chunk works in besides its result: each query row's visible keys, the chunk's keys or values
/// widened, the rows' scores. Every element is written before it is read, so they are reused as they are.
#[derive(Default)]
struct Work {
    spans: Vec<Range<usize>>,
    buf: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    /// A thread's buffers for steps of one token whose keys are one chunk ([`FlashAttention::compute`]): a decode
    /// step is such a step for every session, block and KV head, and allocating these afresh each time was a
    /// dozen allocations per session and block.
    static DECODE_BUFFERS: RefCell<(Work, Partial)> = RefCell::new(Default::default());
}

/// One task: the query tokens `tile` of KV head `bh` (batch x KV heads, flattened) against the keys `keys`.
struct Task {
    bh: usize,
    tile: Range<usize>,
    keys: Range<usize>,
}

impl FlashAttention {
    /// The positions query token `i` of the step sees: `first..last` (exclusive), causal and windowed.
    fn visible(&self, i: usize) -> Range<usize> {
        let query = self.position + i;
        let first = self.window.map_or(0, |w| (query + 1).saturating_sub(w));
        first..query + 1
    }

    /// The positions of a cache holding `len` that any query token of `tile` sees.
    fn visible_to(&self, tile: &Range<usize>, len: usize) -> Range<usize> {
        self.visible(tile.start).start..self.visible(tile.end - 1).end.min(len)
    }

    /// Query tokens per tile: every query row of the group shares each widened chunk of keys.
    fn tile_tokens(&self) -> usize {
        (MAX_ROWS / self.group).max(1)
    }

    /// Scores, softmax and weighted values of the keys `keys` (at most [`KEYS_PER_CHUNK`]) for the query rows of
    /// one tile, into `partial`: row `g * tile.len() + i` is query head `g` of the group at token `tile.start + i`,
    /// read from `q` (the KV head's `[group, tokens, d]` queries).
    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &self,
        q: &[f32],
        (k, v): (Cache<'_>, Cache<'_>),
        (b, h, tokens, d): (usize, usize, usize, usize),
        tile: &Range<usize>,
        keys: Range<usize>,
        partial: &mut Partial,
        work: &mut Work,
    ) {
        let n_tile = tile.len();
        let rows = self.group * n_tile;
        let n = keys.len();
        partial.reset(rows, d);
        let Work { spans, buf, scores } = work;
        // Each query row's visible keys, relative to the chunk (empty when it sees none of them).
        spans.clear();
        spans.extend((0..rows).map(|r| {
            let seen = self.visible(tile.start + r % n_tile);
            let first = seen.start.clamp(keys.start, keys.end) - keys.start;
            let last = seen.end.clamp(keys.start, keys.end) - keys.start;
            first..last.max(first)
        }));
        let query = |r: usize| {
            let row = tile_row(r, tile, tokens);
            &q[row * d..(row + 1) * d]
        };
        // The chunk's keys, then its values, widened once (or borrowed from an f32 cache, or read in place by a
        // few rows): every query row of the tile reads them from cache, not from memory.
        if (k.widens(rows) || v.widens(rows)) && buf.len() < n * d {
            buf.resize(n * d, 0.0);
        }
        if scores.len() < rows * n {
            scores.resize(rows * n, 0.0);
        }
        let kc = k.for_rows((b, h, keys.start, n, d), rows, buf);
        // A decode step's rows (its group) all see the same keys: each key is then read once for all of them.
        let shared = shared_span(spans);
        if let Some(span) = &shared {
            let mut qs: [&[f32]; SHARED_ROWS] = [&[]; SHARED_ROWS];
            for (r, q) in qs.iter_mut().enumerate().take(rows) {
                *q = query(r);
            }
            let mut outs: [&mut [f32]; SHARED_ROWS] = Default::default();
            for (out, row) in outs.iter_mut().zip(scores[..rows * n].chunks_exact_mut(n)) {
                *out = &mut row[span.clone()];
            }
            let keys = kc.range(span.start * d..span.end * d);
            dots_rows(&qs[..rows], keys, &mut outs[..rows]);
        }
        for (r, span) in spans.iter().enumerate() {
            if span.is_empty() {
                continue;
            }
            let seen = &mut scores[r * n + span.start..r * n + span.end];
            if shared.is_none() {
                dots(query(r), kc.range(span.start * d..span.end * d), seen);
            }
            for s in seen.iter_mut() {
                *s *= self.scale;
                if let Some(cap) = self.softcap {
                    *s = cap * (*s / cap).tanh();
                }
            }
            let peak = max(seen);
            exp_shifted(seen, peak);
            partial.max[r] = peak;
            partial.sum[r] = sum(seen);
        }
        let vc = v.for_rows((b, h, keys.start, n, d), rows, buf);
        if let Some(span) = &shared {
            let mut weights: [&[f32]; SHARED_ROWS] = [&[]; SHARED_ROWS];
            for (w, row) in weights.iter_mut().zip(scores[..rows * n].chunks_exact(n)) {
                *w = &row[span.clone()];
            }
            let mut accs: [&mut [f32]; SHARED_ROWS] = Default::default();
            for (acc, row) in accs.iter_mut().zip(partial.acc.chunks_exact_mut(d)) {
                *acc = row;
            }
            let values = vc.range(span.start * d..span.end * d);
            weighted_sums(&weights[..rows], values, &mut accs[..rows]);
        } else {
            for (r, span) in spans.iter().enumerate() {
                let acc = &mut partial.acc[r * d..(r + 1) * d];
                let weights = &scores[r * n + span.start..r * n + span.end];
                weighted_sum(weights, vc.range(span.start * d..span.end * d), acc);
            }
        }
    }

    /// A task's keys, chunk after chunk, merged as they come (flash attention's online softmax).
    fn task(
        &self,
        task: &Task,
        q: &[f32],
        (k, v): (Cache<'_>, Cache<'_>),
        [_, kv_heads, group, tokens, d]: [usize; 5],
    ) -> Partial {
        let (b, h) = (task.bh / kv_heads, task.bh % kv_heads);
        let qh = &q[task.bh * group * tokens * d..(task.bh + 1) * group * tokens * d];
        let mut work = Work::default();
        let mut chunks = chunks(task.keys.clone(), KEYS_PER_CHUNK).map(|keys| {
            let mut partial = Partial::default();
            let at = (b, h, tokens, d);
            self.chunk(qh, (k, v), at, &task.tile, keys, &mut partial, &mut work);
            partial
        });
        let mut partial = chunks
            .next()
            .unwrap_or_else(|| Partial::empty(group * task.tile.len(), d));
        chunks.for_each(|c| partial.merge(&c));
        partial
    }

    /// The attention itself, on slices: `q` `[batch, kv_heads, group, tokens, head_dim]` contiguous (`dims`),
    /// `len` positions of keys and values, `out` as long as `q`.
    pub(crate) fn compute(
        &self,
        q: &[f32],
        dims: [usize; 5],
        (k, v): (Cache<'_>, Cache<'_>),
        len: usize,
        out: &mut [f32],
    ) {
        if !self.compute_one_chunk(q, dims, (k, v), len, out) {
            self.compute_by_tasks(q, dims, (k, v), len, out);
        }
    }

    /// [`Self::compute`] in tasks of a tile and a run of keys each, spread over the threads when the step is big
    /// enough, and each tile's partials merged.
    fn compute_by_tasks(
        &self,
        q: &[f32],
        dims: [usize; 5],
        (k, v): (Cache<'_>, Cache<'_>),
        len: usize,
        out: &mut [f32],
    ) {
        let [batch, kv_heads, group, tokens, d] = dims;
        let tiles: Vec<Range<usize>> = chunks(0..tokens, self.tile_tokens()).collect();
        let whole_tiles = batch * kv_heads * tiles.len() >= TILES_FOR_WHOLE_TILE_TASKS;
        // Tasks in order of (KV head, tile), so each tile's partials are consecutive.
        let mut tasks = Vec::new();
        for bh in 0..batch * kv_heads {
            for tile in &tiles {
                let seen = self.visible_to(tile, len);
                if whole_tiles {
                    tasks.push(Task {
                        bh,
                        tile: tile.clone(),
                        keys: seen,
                    });
                } else {
                    tasks.extend(chunks(seen, KEYS_PER_CHUNK).map(|keys| Task {
                        bh,
                        tile: tile.clone(),
                        keys,
                    }));
                }
            }
        }
        let run = |t: &Task| (t.bh, t.tile.clone(), self.task(t, q, (k, v), dims));
        let partials: Vec<(usize, Range<usize>, Partial)> = if spreads(dims, len) {
            tasks.par_iter().map(run).collect()
        } else {
            tasks.iter().map(run).collect()
        };
        // Merge each tile's partials (consecutive), then normalise every row by its sum.
        for parts in partials.chunk_by(|a, b| (a.0, &a.1) == (b.0, &b.1)) {
            let (bh, tile) = (parts[0].0, &parts[0].1);
            // A tile whose keys were one task (every decode step's, up to a long context) is already whole:
            // merged into an empty partial it would come back the same, bit for bit.
            let mut folded = None;
            let merged = match parts {
                [(_, _, whole)] => whole,
                _ => folded.insert({
                    let mut merged = Partial::empty(group * tile.len(), d);
                    parts.iter().for_each(|(_, _, p)| merged.merge(p));
                    merged
                }),
            };
            write_rows(merged, (bh, tile), dims, self.sinks.as_deref(), out);
        }
    }

    /// [`Self::compute`] for a step of one token whose visible keys are one chunk, computed where it does not
    /// spread over the threads (every decode step up to a long context): each KV head's one task, in this thread's
    /// [`DECODE_BUFFERS`]. The same operations in the same order as the general path, which allocates its
    /// buffers per task and chunk. `false` (nothing written) when the step is not of that kind.
    fn compute_one_chunk(
        &self,
        q: &[f32],
        dims: [usize; 5],
        (k, v): (Cache<'_>, Cache<'_>),
        len: usize,
        out: &mut [f32],
    ) -> bool {
        let [batch, kv_heads, group, tokens, d] = dims;
        let tile = 0..1;
        let seen = self.visible_to(&tile, len);
        if tokens != 1 || spreads(dims, len) || seen.is_empty() || seen.len() > KEYS_PER_CHUNK {
            return false;
        }
        DECODE_BUFFERS.with(|buffers| {
            let Ok(mut buffers) = buffers.try_borrow_mut() else {
                return false;
            };
            let (work, partial) = &mut *buffers;
            for bh in 0..batch * kv_heads {
                let (b, h) = (bh / kv_heads, bh % kv_heads);
                let qh = &q[bh * group * d..(bh + 1) * group * d];
                self.chunk(qh, (k, v), (b, h, 1, d), &tile, seen.clone(), partial, work);
                write_rows(partial, (bh, &tile), dims, self.sinks.as_deref(), out);
            }
            true
        })
    }
}

/// The keys every query row sees, when there are 2 to [`SHARED_ROWS`] rows, all seeing the same keys, and some: a
/// decode step's group of query heads.
fn shared_span(spans: &[Range<usize>]) -> Option<Range<usize>> {
    let first = spans.first()?;
    let shared = (2..=SHARED_ROWS).contains(&spans.len())
        && !first.is_empty()
        && spans.iter().all(|s| s == first);
    shared.then(|| first.clone())
}

/// Whether a step of these dims over `len` keys spreads its tasks over the threads.
fn spreads([batch, kv_heads, ..]: [usize; 5], len: usize) -> bool {
    batch * kv_heads * len >= PARALLEL_KEYS
}

/// The rows of tile `tile` of KV head `bh` (batch x KV heads, flattened) normalised by their sums into `out`
/// (`[batch, kv_heads, group, tokens, head_dim]`, as `dims`). A query head's sink adds `exp(sink - max)` to its
/// rows' sums: one more key of that score, whose value is zero.
fn write_rows(
    merged: &Partial,
    (bh, tile): (usize, &Range<usize>),
    [_, kv_heads, group, tokens, d]: [usize; 5],
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    for r in 0..group * tile.len() {
        let row = bh * group * tokens + tile_row(r, tile, tokens);
        let o = &mut out[row * d..(row + 1) * d];
        let sum = match sinks {
            Some(sinks) => {
                let head = (bh % kv_heads) * group + r / tile.len();
                merged.sum[r] + (sinks[head] - merged.max[r]).exp()
            }
            None => merged.sum[r],
        };
        // No visible key at all cannot happen for a causal step (its own key is always seen): zeros.
        let inv = if merged.sum[r] > 0.0 && sum.is_finite() {
            1.0 / sum
        } else {
            0.0
        };
        for (o, a) in o.iter_mut().zip(&merged.acc[r * d..(r + 1) * d]) {
            *o = a * inv;
        }
    }
}

/// The row, among a KV head's `[group, tokens]` query rows, of row `r` of `tile` (`g * tile.len() + i`: query head
/// `g` of the group at token `tile.start + i`).
fn tile_row(r: usize, tile: &Range<usize>, tokens: usize) -> usize {
    (r / tile.len()) * tokens + tile.start + r % tile.len()
}

/// `range` cut into consecutive pieces of at most `size`.
fn chunks(range: Range<usize>, size: usize) -> impl Iterator<Item = Range<usize>> {
    range
        .clone()
        .step_by(size)
        .map(move |s| s..(s + size).min(range.end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn a_partial_merged_into_an_empty_one_comes_back_bit_for_bit() {
        // What lets `compute` skip merging a tile of one task: a chunk's partial, rows that saw keys and one
        // that saw none.
        let (rows, d, n) = (4, 64, 37);
        let values_of = |dims: &[usize], seed| {
            random(dims, seed)
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (keys, values, q) = (
            values_of(&[n, d], 3),
            values_of(&[n, d], 4),
            values_of(&[rows, d], 5),
        );
        let op = FlashAttention {
            scale: 0.125,
            softcap: None,
            window: Some(30),
            position: n - rows,
            group: 1,
            sinks: None,
        };
        // Keys 0..7 of a chunk: the last query rows see none of them through the window.
        let (k, v) = (
            Cache::f32(&keys, n * d, n * d),
            Cache::f32(&values, n * d, n * d),
        );
        // Buffers reused from one chunk to the next, as a thread's decode buffers are: they must give what fresh
        // ones give.
        let (mut reused, mut dirty) = (Partial::default(), Work::default());
        for keys in [0..n, 0..7, 0..n] {
            let mut part = Partial::default();
            let at = (0, 0, rows, d);
            op.chunk(
                &q,
                (k, v),
                at,
                &(0..rows),
                keys.clone(),
                &mut part,
                &mut Work::default(),
            );
            op.chunk(&q, (k, v), at, &(0..rows), keys, &mut reused, &mut dirty);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&reused.acc), bits(&part.acc));
            assert_eq!(bits(&reused.sum), bits(&part.sum));
            assert_eq!(bits(&reused.max), bits(&part.max));
            let mut merged = Partial::empty(rows, d);
            merged.merge(&part);
            for r in 0..rows {
                if part.sum[r] == 0.0 {
                    // Normalised to zeros either way.
                    assert_eq!(merged.sum[r], 0.0);
                    assert!(part.acc[r * d..(r + 1) * d]
                        .iter()
                        .all(|a| a.to_bits() == 0));
                    continue;
                }
                assert_eq!(merged.max[r].to_bits(), part.max[r].to_bits());
                assert_eq!(merged.sum[r].to_bits(), part.sum[r].to_bits());
            }
            assert_eq!(bits(&merged.acc), bits(&part.acc));
        }
    }

    fn random(dims: &[usize], seed: u64) -> Tensor {
        let n: usize = dims.iter().product();
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    /// The textbook computation with candle ops: repeated KV heads, a full mask, softmax.
    fn reference(op: &FlashAttention, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let (b, h, g, t, d) = q.dims5().unwrap();
        let len = k.dim(2).unwrap();
        let q = q.reshape((b, h, g * t, d)).unwrap();
        let k = k.contiguous().unwrap();
        let v = v.contiguous().unwrap();
        let mut scores = (q.matmul(&k.t().unwrap()).unwrap() * op.scale as f64).unwrap();
        if let Some(cap) = op.softcap {
            scores = ((scores / cap as f64).unwrap().tanh().unwrap() * cap as f64).unwrap();
        }
        let mask: Vec<f32> = (0..g * t)
            .flat_map(|r| {
                let seen = op.visible(r % t);
                (0..len).map(move |j| {
                    if seen.contains(&j) {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (g * t, len), &Device::Cpu).unwrap();
        let scores = scores.broadcast_add(&mask).unwrap();
        let probs = match &op.sinks {
            // Each query head's sink as one more key of value zero.
            Some(sinks) => {
                let column: Vec<f32> = (0..h * g * t).map(|r| sinks[r / t]).collect();
                let column = Tensor::from_vec(column, (1, h, g * t, 1), &Device::Cpu).unwrap();
                let column = column.broadcast_as((b, h, g * t, 1)).unwrap();
                let all = Tensor::cat(&[&scores, &column], 3)
                    .unwrap()
                    .contiguous()
                    .unwrap();
                candle_nn::ops::softmax_last_dim(&all)
                    .unwrap()
                    .narrow(3, 0, len)
                    .unwrap()
            }
            None => candle_nn::ops::softmax_last_dim(&scores).unwrap(),
        };
        probs.matmul(&v).unwrap().reshape((b, h, g, t, d)).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        super::super::test_blocks::largest_abs(&(a - b).unwrap())
    }

    /// The kernel against the reference, over keys and values that are views into buffers with room to grow (as
    /// the cache holds them), with an f32 and an f16 cache.
    fn check(op: FlashAttention, (b, h, tokens, len): (usize, usize, usize, usize)) {
        let (g, d, capacity) = (op.group, 64, len + 13);
        let q = random(&[b, h, g, tokens, d], len as u64);
        let kb = random(&[b, h, capacity, d], 1 + len as u64);
        let vb = random(&[b, h, capacity, d], 2 + len as u64);
        let (k, v) = (kb.narrow(2, 0, len).unwrap(), vb.narrow(2, 0, len).unwrap());
        let got = q.apply_op3_no_bwd(&k, &v, &op).unwrap();
        let want = reference(&op, &q, &k, &v);
        let diff = max_diff(&got, &want);
        assert!(diff < 1e-5, "{op:?}, len {len}, tokens {tokens}: {diff}");
        // An f16 cache: the same as the reference over its values widened to f32.
        let (kh, vh) = (
            kb.to_dtype(DType::F16).unwrap(),
            vb.to_dtype(DType::F16).unwrap(),
        );
        let (kh, vh) = (kh.narrow(2, 0, len).unwrap(), vh.narrow(2, 0, len).unwrap());
        let got = q.apply_op3_no_bwd(&kh, &vh, &op).unwrap();
        let widened = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = reference(&op, &q, &widened(&kh), &widened(&vh));
        let diff = max_diff(&got, &want);
        assert!(
            diff < 1e-5,
            "f16, {op:?}, len {len}, tokens {tokens}: {diff}"
        );
    }

    #[test]
    fn matches_the_textbook_computation_over_views_of_a_larger_cache() {
        // Contexts below and above the parallel threshold and across several chunks; one and several tokens;
        // windows and softcaps; prompts of many tiles, on the calling thread and on the pool.
        for (len, tokens, window, softcap) in [
            (1, 1, None, None),
            (37, 1, None, None),
            (700, 1, None, Some(30.0)),
            (700, 3, Some(100), None),
            (3000, 2, None, None),
            (3000, 1, Some(1024), Some(50.0)),
            (40, 40, None, None),
            (300, 300, None, None),
            (700, 100, Some(64), Some(30.0)),
        ] {
            let op = FlashAttention {
                scale: 0.125,
                softcap,
                window,
                position: len - tokens,
                group: 3,
                sinks: None,
            };
            check(op.clone(), (2, 3, tokens, len));
            // With a sink per query head (gpt-oss), some far above the scores, some below.
            let sinks: Vec<f32> = (0..9).map(|i| i as f32 - 3.0).collect();
            let op = FlashAttention {
                sinks: Some(sinks.into()),
                ..op
            };
            check(op, (2, 3, tokens, len));
        }
    }

    #[test]
    fn one_token_steps_of_one_chunk_equal_the_tasks_path_bit_for_bit() {
        // What the decode path computes in its reused buffers, against the general path's fresh ones: group sizes
        // read in place and widened, one key and a whole chunk, a window within the context, a softcap, two
        // sequences; f32 and f16 caches; the buffers dirtied by each step before the next.
        let d = 64;
        for (group, len, window, softcap, batch) in [
            (3, 1, None, None, 1),
            (3, 37, None, None, 2),
            (1, 256, None, Some(30.0), 1),
            (8, 100, Some(20), None, 1),
            (5, 256, Some(300), Some(50.0), 2),
            (3, 200, None, None, 1),
        ] {
            let op = FlashAttention {
                scale: 0.125,
                softcap,
                window,
                position: len - 1,
                group,
                sinks: None,
            };
            let kv_heads = 3;
            let q = random(&[batch, kv_heads, group, 1, d], len as u64)
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let keys = random(&[batch, kv_heads, len, d], 1 + len as u64);
            let values = random(&[batch, kv_heads, len, d], 2 + len as u64);
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (kf, vf) = (flat(&keys), flat(&values));
            let halves = |x: &[f32]| {
                x.iter()
                    .map(|v| half::f16::from_f32(*v))
                    .collect::<Vec<_>>()
            };
            let (kh, vh) = (halves(&kf), halves(&vf));
            let dims = [batch, kv_heads, group, 1, d];
            let strides = (kv_heads * len * d, len * d);
            let caches = [
                (
                    Cache::f32(&kf, strides.0, strides.1),
                    Cache::f32(&vf, strides.0, strides.1),
                ),
                (
                    Cache::host(&kh, (kv_heads, len, d)),
                    Cache::host(&vh, (kv_heads, len, d)),
                ),
            ];
            for (k, v) in caches {
                let mut general = vec![f32::NAN; q.len()];
                op.compute_by_tasks(&q, dims, (k, v), len, &mut general);
                let mut one_chunk = vec![f32::NAN; q.len()];
                assert!(op.compute_one_chunk(&q, dims, (k, v), len, &mut one_chunk));
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&one_chunk),
                    bits(&general),
                    "group {group}, {len} keys, window {window:?}"
                );
            }
        }
        // Steps of several tokens, or of more keys than a chunk, are left to the tasks path.
        let op = FlashAttention {
            scale: 0.125,
            softcap: None,
            window: None,
            position: 299,
            group: 3,
            sinks: None,
        };
        let (q, keys) = (vec![0f32; 3 * 64], vec![0f32; 300 * 64]);
        let cache = Cache::f32(&keys, 300 * 64, 300 * 64);
        let mut out = vec![0f32; q.len()];
        assert!(!op.compute_one_chunk(&q, [1, 1, 3, 1, 64], (cache, cache), 300, &mut out));
    }

    #[test]
    fn tiles_fit_every_group_size() {
        // One query head per KV head (64 tokens a tile), more heads than a tile has rows, and a tile that does
        // not divide the prompt.
        for group in [1, 5, 8, 80] {
            let op = FlashAttention {
                scale: 0.125,
                softcap: None,
                window: None,
                position: 20,
                group,
                sinks: None,
            };
            check(op, (1, 2, 150, 170));
        }
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        let op = FlashAttention {
            scale: 1.0,
            softcap: None,
            window: None,
            position: 3,
            group: 2,
            sinks: None,
        };
        let q = random(&[1, 2, 2, 1, 8], 1);
        let k = random(&[1, 2, 4, 8], 2);
        // Too few keys for the position, wrong dtype, wrong group, and keys whose rows are not contiguous.
        let short = k.narrow(2, 0, 3).unwrap();
        assert!(q.apply_op3_no_bwd(&short, &short, &op).is_err());
        let bf16 = k.to_dtype(DType::BF16).unwrap();
        assert!(q.apply_op3_no_bwd(&bf16, &bf16, &op).is_err());
        let other = FlashAttention {
            group: 3,
            ..op.clone()
        };
        assert!(q.apply_op3_no_bwd(&k, &k, &other).is_err());
        let transposed = random(&[1, 2, 8, 4], 3).transpose(2, 3).unwrap();
        assert!(q.apply_op3_no_bwd(&transposed, &transposed, &op).is_err());
        assert!(q.apply_op3_no_bwd(&k, &k, &op).is_ok());
    }
}

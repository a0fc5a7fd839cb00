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
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::ops::Range;

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
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlashAttention {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
    pub position: usize,
    pub group: usize,
}

/// A partial result for every query row of a tile: running maximum, sum of exponentials, and the values weighted
/// by those exponentials.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl Partial {
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

/// The cache's elements: f32, or f16 widened a chunk of positions at a time as they are read.
#[derive(Clone, Copy)]
enum Elems<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

/// Keys or values of the cache, as the kernel reads them.
#[derive(Clone, Copy)]
struct Cache<'a> {
    data: Elems<'a>,
    offset: usize,
    batch_stride: usize,
    head_stride: usize,
}

impl Cache<'_> {
    /// Rows `first..first + n` of head `h` of sequence `b` (contiguous in the cache), in f32: borrowed from an f32
    /// cache, widened into `buf` from an f16 one.
    fn rows<'s>(
        &'s self,
        (b, h, first, n, d): (usize, usize, usize, usize, usize),
        buf: &'s mut [f32],
    ) -> &'s [f32] {
        let start = self.offset + b * self.batch_stride + h * self.head_stride + first * d;
        match self.data {
            Elems::F32(x) => &x[start..start + n * d],
            Elems::F16(x) => {
                x[start..start + n * d].convert_to_f32_slice(&mut buf[..n * d]);
                &buf[..n * d]
            }
        }
    }
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

    /// The positions any query token of `tile` sees.
    fn visible_to(&self, tile: &Range<usize>) -> Range<usize> {
        self.visible(tile.start).start..self.visible(tile.end - 1).end
    }

    /// Query tokens per tile: every query row of the group shares each widened chunk of keys.
    fn tile_tokens(&self) -> usize {
        (MAX_ROWS / self.group).max(1)
    }

    /// Scores, softmax and weighted values of the keys `keys` (at most [`KEYS_PER_CHUNK`]) for the query rows of
    /// one tile: row `g * tile.len() + i` is query head `g` of the group at token `tile.start + i`, read from
    /// `q` (the KV head's `[group, tokens, d]` queries).
    fn chunk(
        &self,
        q: &[f32],
        (k, v): (Cache<'_>, Cache<'_>),
        (b, h, tokens, d): (usize, usize, usize, usize),
        tile: &Range<usize>,
        keys: Range<usize>,
    ) -> Partial {
        let n_tile = tile.len();
        let rows = self.group * n_tile;
        let n = keys.len();
        let mut partial = Partial::empty(rows, d);
        // Each query row's visible keys, relative to the chunk (empty when it sees none of them).
        let spans: Vec<Range<usize>> = (0..rows)
            .map(|r| {
                let seen = self.visible(tile.start + r % n_tile);
                let first = seen.start.clamp(keys.start, keys.end) - keys.start;
                let last = seen.end.clamp(keys.start, keys.end) - keys.start;
                first..last.max(first)
            })
            .collect();
        let query = |r: usize| {
            let row = (r / n_tile) * tokens + tile.start + r % n_tile;
            &q[row * d..(row + 1) * d]
        };
        // The chunk's keys, then its values, widened once (or borrowed from an f32 cache): every query row of the
        // tile reads them from cache, not from memory.
        let mut buf = vec![0f32; n * d];
        let mut scores = vec![0f32; rows * n];
        let kc = k.rows((b, h, keys.start, n, d), &mut buf);
        for (r, span) in spans.iter().enumerate() {
            if span.is_empty() {
                continue;
            }
            let seen = &mut scores[r * n + span.start..r * n + span.end];
            dots(query(r), &kc[span.start * d..span.end * d], seen);
            for s in seen.iter_mut() {
                *s *= self.scale;
                if let Some(cap) = self.softcap {
                    *s = cap * (*s / cap).tanh();
                }
            }
            let max = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            exp_shifted(seen, max);
            partial.max[r] = max;
            partial.sum[r] = sum(seen);
        }
        let vc = v.rows((b, h, keys.start, n, d), &mut buf);
        for (r, span) in spans.iter().enumerate() {
            let acc = &mut partial.acc[r * d..(r + 1) * d];
            let weights = &scores[r * n + span.start..r * n + span.end];
            weighted_sum(weights, &vc[span.start * d..span.end * d], acc);
        }
        partial
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
        let mut chunks = chunks(task.keys.clone(), KEYS_PER_CHUNK)
            .map(|keys| self.chunk(qh, (k, v), (b, h, tokens, d), &task.tile, keys));
        let mut partial = chunks
            .next()
            .unwrap_or_else(|| Partial::empty(group * task.tile.len(), d));
        chunks.for_each(|c| partial.merge(&c));
        partial
    }

    /// The attention itself, on slices; `q` contiguous, `out` the same length.
    fn compute(
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
                let seen = self.visible_to(tile);
                let seen = seen.start..seen.end.min(len);
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
        let partials: Vec<(usize, Range<usize>, Partial)> =
            if batch * kv_heads * len >= PARALLEL_KEYS {
                tasks.par_iter().map(run).collect()
            } else {
                tasks.iter().map(run).collect()
            };
        // Merge each tile's partials, then normalise every row by its sum.
        let mut i = 0;
        while i < partials.len() {
            let (bh, tile) = (partials[i].0, partials[i].1.clone());
            let mut j = i + 1;
            while j < partials.len() && partials[j].0 == bh && partials[j].1 == tile {
                j += 1;
            }
            let mut merged = Partial::empty(group * tile.len(), d);
            partials[i..j].iter().for_each(|(_, _, p)| merged.merge(p));
            for r in 0..group * tile.len() {
                let row =
                    bh * group * tokens + (r / tile.len()) * tokens + tile.start + r % tile.len();
                let o = &mut out[row * d..(row + 1) * d];
                // No visible key at all cannot happen for a causal step (its own key is always seen): zeros.
                let inv = if merged.sum[r] > 0.0 {
                    1.0 / merged.sum[r]
                } else {
                    0.0
                };
                for (o, a) in o.iter_mut().zip(&merged.acc[r * d..(r + 1) * d]) {
                    *o = a * inv;
                }
            }
            i = j;
        }
    }
}

/// `range` cut into consecutive pieces of at most `size`.
fn chunks(range: Range<usize>, size: usize) -> impl Iterator<Item = Range<usize>> {
    range
        .clone()
        .step_by(size)
        .map(move |s| s..(s + size).min(range.end))
}

/// `out[j] = q . k_j` for the rows `k_j` of `keys` (each as long as `q`).
fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if q.len().is_multiple_of(8) && x86::available() {
        // SAFETY: the CPU has AVX2 and FMA; the lengths are checked by the kernel's asserts.
        return unsafe { x86::dots(q, keys, out) };
    }
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
        *o = q.iter().zip(k).map(|(a, b)| a * b).sum();
    }
}

/// `acc += sum_j w_j v_j` over the rows `v_j` of `values` (each as long as `acc`).
fn weighted_sum(weights: &[f32], values: &[f32], acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if acc.len().is_multiple_of(8) && x86::available() {
        // SAFETY: as in `dots`.
        return unsafe { x86::weighted_sum(weights, values, acc) };
    }
    for (w, v) in weights.iter().zip(values.chunks_exact(acc.len())) {
        axpy(*w, v, acc);
    }
}

/// The two inner loops with AVX2: eight keys' dot products at once, reduced together (one horizontal reduction
/// per eight keys instead of per key), and values accumulated in registers 64 columns at a time.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE
            .get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let d = q.len();
        let n = out.len();
        assert!(d.is_multiple_of(8) && keys.len() >= n * d);
        let (q, k) = (q.as_ptr(), keys.as_ptr());
        let mut j = 0;
        while j + 8 <= n {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(q.add(c));
                for (jj, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k.add((j + jj) * d + c)), *a);
                }
            }
            _mm256_storeu_ps(out.as_mut_ptr().add(j), reduce8(&acc));
            j += 8;
        }
        while j < n {
            let mut a = _mm256_setzero_ps();
            for c in (0..d).step_by(8) {
                a = _mm256_fmadd_ps(
                    _mm256_loadu_ps(q.add(c)),
                    _mm256_loadu_ps(k.add(j * d + c)),
                    a,
                );
            }
            let r = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
            let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
            out[j] = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
            j += 1;
        }
    }

    /// Eight vectors to the vector of their eight totals.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce8(v: &[__m256; 8]) -> __m256 {
        let s01 = _mm256_hadd_ps(v[0], v[1]);
        let s23 = _mm256_hadd_ps(v[2], v[3]);
        let s45 = _mm256_hadd_ps(v[4], v[5]);
        let s67 = _mm256_hadd_ps(v[6], v[7]);
        let s0123 = _mm256_hadd_ps(s01, s23);
        let s4567 = _mm256_hadd_ps(s45, s67);
        // Each 128-bit half holds one half's sums of vectors 0..4 (then 4..8): add the halves.
        _mm256_add_ps(
            _mm256_permute2f128_ps(s0123, s4567, 0x20),
            _mm256_permute2f128_ps(s0123, s4567, 0x31),
        )
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(weights: &[f32], values: &[f32], acc: &mut [f32]) {
        const BLOCK: usize = 64;
        let d = acc.len();
        let n = weights.len();
        assert!(d.is_multiple_of(8) && values.len() >= n * d);
        let v = values.as_ptr();
        let mut c0 = 0;
        while c0 < d {
            let width = BLOCK.min(d - c0) / 8;
            let mut regs = [_mm256_setzero_ps(); BLOCK / 8];
            for (i, r) in regs[..width].iter_mut().enumerate() {
                *r = _mm256_loadu_ps(acc.as_ptr().add(c0 + 8 * i));
            }
            for (j, w) in weights.iter().enumerate() {
                let w = _mm256_set1_ps(*w);
                for (i, r) in regs[..width].iter_mut().enumerate() {
                    *r = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(j * d + c0 + 8 * i)), *r);
                }
            }
            for (i, r) in regs[..width].iter().enumerate() {
                _mm256_storeu_ps(acc.as_mut_ptr().add(c0 + 8 * i), *r);
            }
            c0 += BLOCK;
        }
    }
}

/// `y += a * x`.
#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// A sum in eight independent lanes (vectorised; the order differs from a sequential sum only by rounding).
fn sum(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            lanes[l] += c[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `x = exp(x - max)` for scores at most `max`, in straight-line code the compiler vectorises: `2^n * p(r)` with
/// `x - max = n ln 2 + r`, `|r| <= ln 2 / 2`, and Cephes' degree-7 polynomial for `e^r` (within 2 ulp of `expf`).
/// Arguments below -87 (weights under 1e-38) give 0.
fn exp_shifted(xs: &mut [f32], max: f32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two, so `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
    for x in xs.iter_mut() {
        let shifted = *x - max;
        let a = shifted.max(-87.0);
        let n = (a * LOG2E + 0.5).floor();
        let r = a - n * LN2_HI - n * LN2_LO;
        let mut p = P[0];
        for c in &P[1..] {
            p = p * r + *c;
        }
        let e = p * r * r + r + 1.0;
        let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
        *x = if shifted < -87.0 { 0.0 } else { e * scale };
    }
}

fn f32_slice<'a>(s: &'a CpuStorage, what: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        other => candle_core::bail!("flash attention: {what} are {:?}, not f32", other.dtype()),
    }
}

/// The cache's layout as the kernel reads it: `[batch, kv_heads, len, head_dim]` with contiguous rows.
fn cache_view<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
    (batch, kv_heads, d): (usize, usize, usize),
) -> candle_core::Result<(Cache<'a>, usize)> {
    let (data, elems) = match s {
        CpuStorage::F32(v) => (Elems::F32(v), v.len()),
        CpuStorage::F16(v) => (Elems::F16(v), v.len()),
        other => candle_core::bail!(
            "flash attention: {what} are {:?}, not f32 or f16",
            other.dtype()
        ),
    };
    let (dims, stride) = (l.dims(), l.stride());
    if dims.len() != 4 || dims[0] != batch || dims[1] != kv_heads || dims[3] != d {
        candle_core::bail!(
            "flash attention: {what} {dims:?} for queries with {batch} x {kv_heads} x {d}"
        );
    }
    if stride[3] != 1 || stride[2] != d {
        candle_core::bail!("flash attention: {what} rows are not contiguous ({stride:?})");
    }
    let len = dims[2];
    let last = l.start_offset() + (batch - 1) * stride[0] + (kv_heads - 1) * stride[1] + len * d;
    if len > 0 && last > elems {
        candle_core::bail!("flash attention: {what} layout runs past its storage");
    }
    let view = Cache {
        data,
        offset: l.start_offset(),
        batch_stride: stride[0],
        head_stride: stride[1],
    };
    Ok((view, len))
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "petal-flash-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = ql.contiguous_offsets() else {
            candle_core::bail!("flash attention: queries must be contiguous");
        };
        let q = &f32_slice(qs, "queries")?[start..end];
        let dims: [usize; 5] = match ql.dims() {
            &[b, h, g, t, d] if g == self.group => [b, h, g, t, d],
            other => {
                candle_core::bail!("flash attention: queries {other:?}, group {}", self.group)
            }
        };
        let [b, h, _, _, d] = dims;
        let (k, len) = cache_view(ks, kl, "keys", (b, h, d))?;
        let (v, vlen) = cache_view(vs, vl, "values", (b, h, d))?;
        if vlen != len || len < self.position + dims[3] {
            candle_core::bail!(
                "flash attention: {len} keys and {vlen} values for {} tokens at position {}",
                dims[3],
                self.position
            );
        }
        let mut out = vec![0f32; q.len()];
        self.compute(q, dims, (k, v), len, &mut out);
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

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
        let probs = candle_nn::ops::softmax_last_dim(&scores).unwrap();
        probs.matmul(&v).unwrap().reshape((b, h, g, t, d)).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
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
            };
            check(op, (2, 3, tokens, len));
        }
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
            };
            check(op, (1, 2, 150, 170));
        }
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_expf() {
        let mut xs: Vec<f32> = (0..=870_000).map(|i| -(i as f32) * 1e-4).collect();
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        exp_shifted(&mut xs, 0.0);
        for (i, (got, want)) in xs.iter().zip(&want).enumerate() {
            let err = (got - want).abs() / want;
            assert!(err < 5e-7, "exp({}): {got} vs {want}", -(i as f32) * 1e-4);
        }
        // Shifted by the maximum, and far below it: exactly 1, and 0.
        let mut xs = [3.5f32, -200.0];
        exp_shifted(&mut xs, 3.5);
        assert_eq!(xs, [1.0, 0.0]);
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        let op = FlashAttention {
            scale: 1.0,
            softcap: None,
            window: None,
            position: 3,
            group: 2,
        };
        let q = random(&[1, 2, 2, 1, 8], 1);
        let k = random(&[1, 2, 4, 8], 2);
        // Too few keys for the position, wrong dtype, wrong group, and keys whose rows are not contiguous.
        let short = k.narrow(2, 0, 3).unwrap();
        assert!(q.apply_op3_no_bwd(&short, &short, &op).is_err());
        let bf16 = k.to_dtype(DType::BF16).unwrap();
        assert!(q.apply_op3_no_bwd(&bf16, &bf16, &op).is_err());
        let other = FlashAttention { group: 3, ..op };
        assert!(q.apply_op3_no_bwd(&k, &k, &other).is_err());
        let transposed = random(&[1, 2, 8, 4], 3).transpose(2, 3).unwrap();
        assert!(q.apply_op3_no_bwd(&transposed, &transposed, &op).is_err());
        assert!(q.apply_op3_no_bwd(&k, &k, &op).is_ok());
    }
}

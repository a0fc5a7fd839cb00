//! Activations quantized to Q8_1 blocks, the form the Q4_1 dot product takes them in.
//!
//! Bit-for-bit the quantization of ggml's `quantize_row_q8_1` as candle implements it (including the half-precision
//! product for `s`); the scales are kept as the f32 values of those halves, converted once per row instead of once
//! per weight row that meets them.
use half::f16;
use rayon::prelude::*;

/// Values per block.
pub const QK8_1: usize = 32;

/// Rows of activations, each `blocks` blocks of 32 signed bytes with scale `d` and `s = d * sum(qs)`.
#[derive(Debug, Default)]
pub struct Q8Rows {
    pub blocks: usize,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub qs: Vec<[i8; QK8_1]>,
    /// Each block's `sum(qs)` itself, exact (the Q5_0 product takes `16 * sum` off its unsigned sums).
    pub sum: Vec<i32>,
    /// `d` and `s` again, block by block, each repeated in eight lanes; empty unless asked for (only the 256-bit
    /// kernels read them).
    pub splat: Vec<SplatScales>,
}

/// One row of [`Q8Rows`].
#[derive(Debug, Clone, Copy)]
pub struct Q8Row<'a> {
    pub d: &'a [f32],
    pub s: &'a [f32],
    pub qs: &'a [[i8; QK8_1]],
    pub sum: &'a [i32],
    pub splat: &'a [SplatScales],
}

/// A block's two scales, each repeated in eight lanes, as a 256-bit kernel multiplies by them: it loads them as
/// they are, where broadcasting a scalar takes a vector pipe once per block, activation row and group of weight
/// rows, on the pipes the kernel's products are short of. (The AVX2 Q4_1 tile in cache, Zen 3: 1.08-1.13x faster
/// than before with its rows read through pointers alone, 1.26-1.29x with these too.)
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[repr(C, align(32))]
pub struct SplatScales {
    pub d: [f32; 8],
    pub s: [f32; 8],
}

impl SplatScales {
    fn new(d: f32, s: f32) -> Self {
        Self {
            d: [d; 8],
            s: [s; 8],
        }
    }
}

/// Blocks from which quantizing is worth a parallel region, and blocks per task.
const PARALLEL_BLOCKS: usize = 256;
const TASK_BLOCKS: usize = 64;

impl Q8Rows {
    /// Quantizes `m` rows of `x` (row-major, a multiple of 32 values per row), with each block's [`SplatScales`]
    /// when `with_splat_scales` (64 bytes a block that kernels other than the 256-bit ones never read).
    pub fn quantize(x: &[f32], m: usize, with_splat_scales: bool) -> Self {
        let blocks = x.len().checked_div(m).unwrap_or(0) / QK8_1;
        let n = m * blocks;
        let mut rows = Self {
            blocks,
            d: vec![0.0; n],
            s: vec![0.0; n],
            qs: vec![[0; QK8_1]; n],
            sum: vec![0; n],
            splat: vec![SplatScales::default(); if with_splat_scales { n } else { 0 }],
        };
        let (d, s, qs, sum, splat) = (
            &mut rows.d,
            &mut rows.s,
            &mut rows.qs,
            &mut rows.sum,
            &mut rows.splat,
        );
        // Each block is quantized on its own, so splitting the work changes nothing. For a batch of 16 decode rows
        // (288 to 768 blocks) one thread would take 4 to 10 µs, but the pool's other threads would fall asleep
        // meanwhile, and the matmul's first groups then wait for them to wake (a trace of the 16-session test: its
        // kernels 15% slower): the region keeps them busy.
        if n >= PARALLEL_BLOCKS {
            let tasks = x
                .par_chunks(QK8_1 * TASK_BLOCKS)
                .zip(d.par_chunks_mut(TASK_BLOCKS))
                .zip(s.par_chunks_mut(TASK_BLOCKS))
                .zip(qs.par_chunks_mut(TASK_BLOCKS))
                .zip(sum.par_chunks_mut(TASK_BLOCKS));
            // Zipped with an empty `splat`, the tasks would be none at all: two arms.
            if with_splat_scales {
                tasks.zip(splat.par_chunks_mut(TASK_BLOCKS)).for_each(
                    |(((((x, d), s), qs), sum), splat)| {
                        quantize_blocks(x, d, s, qs, sum);
                        splat_scales(d, s, splat);
                    },
                );
            } else {
                tasks.for_each(|((((x, d), s), qs), sum)| quantize_blocks(x, d, s, qs, sum));
            }
        } else {
            quantize_blocks(x, d, s, qs, sum);
            // Nothing to write when they were not asked for (`splat` is empty).
            splat_scales(d, s, splat);
        }
        rows
    }

    pub fn row(&self, i: usize) -> Q8Row<'_> {
        let r = i * self.blocks..(i + 1) * self.blocks;
        Q8Row {
            d: &self.d[r.clone()],
            s: &self.s[r.clone()],
            qs: &self.qs[r.clone()],
            sum: &self.sum[r.clone()],
            // Empty when they were not asked for.
            splat: if self.splat.is_empty() {
                &[]
            } else {
                &self.splat[r]
            },
        }
    }
}

/// `splat[i]` from `d[i]` and `s[i]`.
fn splat_scales(d: &[f32], s: &[f32], splat: &mut [SplatScales]) {
    for ((splat, &d), &s) in splat.iter_mut().zip(d).zip(s) {
        *splat = SplatScales::new(d, s);
    }
}

/// Consecutive blocks of `x` into `d`, `s`, `qs` and `sum`.
fn quantize_blocks(
    x: &[f32],
    d: &mut [f32],
    s: &mut [f32],
    qs: &mut [[i8; QK8_1]],
    sum: &mut [i32],
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "f16c"
    ))]
    // SAFETY: the build enables AVX2 and F16C (x86-64-v3, see `scale_round`).
    let done = unsafe { avx2::quantize_eights(x, d, s, qs, sum) };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "f16c"
    )))]
    let done = 0;
    let x = x.chunks_exact(QK8_1).skip(done);
    for ((((xs, d), s), qs), sum) in x
        .zip(&mut d[done..])
        .zip(&mut s[done..])
        .zip(&mut qs[done..])
        .zip(&mut sum[done..])
    {
        (*d, *s, *sum) = quantize_block(xs, qs);
    }
}

/// One block: returns `(d, s)` as the f32 values of their halves, and `sum(qs)`.
fn quantize_block(xs: &[f32], qs: &mut [i8; QK8_1]) -> (f32, f32, i32) {
    let d = abs_max(xs) / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let sum = scale_round(xs, id, qs);
    let d = f16::from_f32(d);
    let s = f16::from_f32(sum as f32) * d;
    (d.to_f32(), s.to_f32(), sum)
}

/// `qs[i] = round(xs[i] * id) as i8` (half away from zero; NaN to 0) and the sum of the `qs`.
fn scale_round(xs: &[f32], id: f32, qs: &mut [i8; QK8_1]) -> i32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if let Ok(xs) = <&[f32; QK8_1]>::try_from(xs) {
        // SAFETY: the build enables AVX2 (x86-64-v3, see .cargo/config.toml), so every CPU it runs on has it.
        return unsafe { avx2::scale_round(xs, id, qs) };
    }
    let mut sum = 0;
    for (q, x) in qs.iter_mut().zip(xs) {
        *q = round_half_away(x * id) as i8;
        sum += *q as i32;
    }
    sum
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
mod avx2 {
    use super::QK8_1;
    use std::arch::x86_64::*;

    /// [`super::abs_max`] of one block: `max(|x|, m)` keeps `m` when `|x|` is NaN, as `f32::max` does.
    #[target_feature(enable = "avx2")]
    pub unsafe fn abs_max(xs: &[f32; QK8_1]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for k in 0..QK8_1 / 8 {
            m = _mm256_max_ps(
                _mm256_andnot_ps(sign, _mm256_loadu_ps(xs.as_ptr().add(8 * k))),
                m,
            );
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        _mm_cvtss_f32(m)
    }

    /// [`super::quantize_block`] on eight blocks at a time, as many as there are whole eights; returns how many
    /// blocks it did. One block alone is a chain of two divisions and half-precision round trips, each waiting on
    /// the last; eight blocks' share one vector division each, and their conversions one instruction each (F16C
    /// rounds to nearest even, as `half` does).
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn quantize_eights(
        x: &[f32],
        d: &mut [f32],
        s: &mut [f32],
        qs: &mut [[i8; QK8_1]],
        sum: &mut [i32],
    ) -> usize {
        let n = (x.len() / QK8_1)
            .min(d.len())
            .min(s.len())
            .min(qs.len())
            .min(sum.len())
            / 8
            * 8;
        let block = |i: usize| &*(x.as_ptr().add(i * QK8_1) as *const [f32; QK8_1]);
        for first in (0..n).step_by(8) {
            let amax: [f32; 8] = std::array::from_fn(|j| abs_max(block(first + j)));
            let dv = _mm256_div_ps(_mm256_loadu_ps(amax.as_ptr()), _mm256_set1_ps(127.0));
            // `if d != 0 { 1 / d } else { 0 }`
            let nonzero = _mm256_cmp_ps(dv, _mm256_setzero_ps(), _CMP_NEQ_UQ);
            let idv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0), dv), nonzero);
            let mut ids = [0f32; 8];
            _mm256_storeu_ps(ids.as_mut_ptr(), idv);
            let sums: [i32; 8] =
                std::array::from_fn(|j| scale_round(block(first + j), ids[j], &mut qs[first + j]));
            let d16 = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(dv));
            let sum16 = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
                _mm256_cvtepi32_ps(_mm256_loadu_si256(sums.as_ptr() as *const __m256i)),
            ));
            let s16 = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(
                sum16, d16,
            )));
            _mm256_storeu_ps(d.as_mut_ptr().add(first), d16);
            _mm256_storeu_ps(s.as_mut_ptr().add(first), s16);
            sum[first..first + 8].copy_from_slice(&sums);
        }
        n
    }

    /// [`super::scale_round`] eight values at a time: `round` from `trunc` as in `round_half_away`, NaNs masked to
    /// zero (as `as i8` makes them), then narrowed with saturating packs (values are within [-127, 127]).
    #[target_feature(enable = "avx2")]
    pub unsafe fn scale_round(xs: &[f32; QK8_1], id: f32, qs: &mut [i8; QK8_1]) -> i32 {
        let sign = _mm256_set1_ps(-0.0);
        let (half, one, scale) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0), _mm256_set1_ps(id));
        let ints: [__m256i; 4] = std::array::from_fn(|k| {
            let v = _mm256_mul_ps(_mm256_loadu_ps(xs.as_ptr().add(8 * k)), scale);
            let t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let away = _mm256_cmp_ps(
                _mm256_andnot_ps(sign, _mm256_sub_ps(v, t)),
                half,
                _CMP_GE_OQ,
            );
            let step = _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(v, sign), one));
            let rounded = _mm256_and_ps(_mm256_add_ps(t, step), _mm256_cmp_ps(v, v, _CMP_ORD_Q));
            _mm256_cvttps_epi32(rounded)
        });
        // Packs work within 128-bit halves: bytes come out in the order 0-3, 8-11, 16-19, 24-27, 4-7, ...
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(ints[0], ints[1]),
            _mm256_packs_epi32(ints[2], ints[3]),
        );
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, ordered);
        let total = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let half_sum = _mm_add_epi32(
            _mm256_castsi256_si128(total),
            _mm256_extracti128_si256(total, 1),
        );
        let s = _mm_add_epi32(half_sum, _mm_shuffle_epi32(half_sum, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }
}

/// The largest `|x|` of `xs` (a multiple of 8 long), NaNs skipped, as `fold(0, max)` gives it.
#[inline(always)]
pub(super) fn abs_max(xs: &[f32]) -> f32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if let Ok(xs) = <&[f32; QK8_1]>::try_from(xs) {
        // SAFETY: the build enables AVX2 (see `scale_round`).
        return unsafe { avx2::abs_max(xs) };
    }
    let mut lanes = [0f32; 8];
    for c in xs.chunks_exact(8) {
        for (m, x) in lanes.iter_mut().zip(c) {
            *m = m.max(x.abs());
        }
    }
    lanes.iter().fold(0f32, |a, &m| a.max(m))
}

/// `v.round()`: `v - trunc(v)` is exact, so comparing it with one half decides the rounding exactly.
#[inline(always)]
pub(super) fn round_half_away(v: f32) -> f32 {
    let t = v.trunc();
    if (v - t).abs() >= 0.5 {
        t + 1f32.copysign(v)
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantizes_as_the_plain_loop_does_ties_and_extremes_included() {
        let reference = |xs: &[f32]| {
            let amax = xs.iter().fold(0f32, |a, x| a.max(x.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let qs: Vec<i8> = xs.iter().map(|x| (x * id).round() as i8).collect();
            let sum: i32 = qs.iter().map(|&q| q as i32).sum();
            let d = f16::from_f32(d);
            (
                qs,
                d.to_f32(),
                (f16::from_f32(sum as f32) * d).to_f32(),
                sum,
            )
        };
        let mut seed = 1u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let mut blocks: Vec<Vec<f32>> = vec![
            vec![0.0; 32],
            // amax 127: scale 1, so every k + 0.5 is a tie.
            (0..32)
                .map(|i| if i == 0 { 127.0 } else { i as f32 * 0.5 - 8.0 })
                .collect(),
            (0..32)
                .map(|i| {
                    if i == 0 {
                        -127.0
                    } else {
                        0.49999997 * (i % 3) as f32
                    }
                })
                .collect(),
            (0..32)
                .map(|i| if i % 2 == 0 { f32::NAN } else { i as f32 })
                .collect(),
        ];
        for _ in 0..2000 {
            let scale = [1e-6f32, 0.01, 1.0, 300.0][(next() % 4) as usize];
            blocks.push(
                (0..32)
                    .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * scale)
                    .collect(),
            );
        }
        for xs in &blocks {
            let mut qs = [0i8; QK8_1];
            let (d, s, sum) = quantize_block(xs, &mut qs);
            let (want_qs, want_d, want_s, want_sum) = reference(xs);
            assert_eq!(
                (qs.to_vec(), d.to_bits(), s.to_bits(), sum),
                (want_qs, want_d.to_bits(), want_s.to_bits(), want_sum),
                "{xs:?}"
            );
        }
        // And as rows: eight blocks at a time, then a tail; in parallel tasks past `PARALLEL_BLOCKS`.
        let x: Vec<f32> = blocks.concat();
        for (m, with_splat_scales) in [(1, true), (4, true), (1, false), (4, false)] {
            let rows = Q8Rows::quantize(&x, m, with_splat_scales);
            if !with_splat_scales {
                assert!(rows.splat.is_empty() && rows.row(0).splat.is_empty());
            }
            for (i, xs) in blocks.iter().enumerate() {
                let (want_qs, want_d, want_s, want_sum) = reference(xs);
                assert_eq!(
                    (
                        rows.qs[i].to_vec(),
                        rows.d[i].to_bits(),
                        rows.s[i].to_bits(),
                        rows.sum[i]
                    ),
                    (want_qs, want_d.to_bits(), want_s.to_bits(), want_sum),
                    "block {i} of {m} rows: {xs:?}"
                );
                if !with_splat_scales {
                    continue;
                }
                let lanes = rows.splat[i].d.iter().chain(&rows.splat[i].s);
                let want = [[want_d; 8], [want_s; 8]].concat();
                assert!(
                    lanes.zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "block {i}'s splat scales: {:?}",
                    rows.splat[i]
                );
            }
        }
    }
}

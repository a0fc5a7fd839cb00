//! The Q5_0 x Q8_0 products of one group of interleaved weight rows ([`super::GROUP_ROWS`]) with a tile of
//! activation rows: a scalar reference and x86 kernels chosen at run time.
//!
//! As for Q4_1 ([`super::super::q4_1::Kernel`]), each vector lane belongs to a weight row and meets activation bytes
//! broadcast to every lane. A weight's five bits are its nibble with the fifth bit added where its part's mask says,
//! an unsigned byte up to 31; the product against the signed activations is taken unsigned, and the offset of 16 is
//! taken off after: `sum((q - 16) * y) = sum(q * y) - 16 * sum(y)`, each activation block's `sum(y)` as its
//! quantization counted it (`Q8Row::sum`). Integer sums are exact, so every kernel gives the reference's result bit for bit: each row's
//! float terms `(sumi * d_w) * d_y` formed and added in the reference's order (one lane, block after block, no fused
//! multiply-add), as candle's `vec_dot_q5_0_q8_0` does.
use super::super::{fifth_bits, q8_1::Q8Row};
use super::{Q5_0Group, BLOCK_MASKS, BLOCK_QS, GROUP_ROWS, PART_BYTES};

pub use super::super::VectorKernel as Kernel;

/// `out[r][k] = dot(row k of w, ys[r])` for every activation row, each as long as `w`'s rows.
pub fn group_dots(
    kernel: Kernel,
    w: Q5_0Group<'_>,
    ys: &[Q8Row<'_>],
    out: &mut [[f32; GROUP_ROWS]],
) {
    let nb = w.blocks();
    assert!(
        w.qs.len() == nb * BLOCK_QS
            && w.high.len() == nb * BLOCK_MASKS
            && ys
                .iter()
                .all(|y| y.d.len() == nb && y.qs.len() == nb && y.sum.len() == nb)
            && out.len() >= ys.len()
    );
    match kernel {
        Kernel::Scalar => group_scalar(w, ys, out),
        // SAFETY (both): `available` lists a kernel only after checking the CPU has its features; lengths were
        // checked above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::group_dots(w, ys, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => unsafe { avx512_vnni::group_dots(w, ys, out) },
    }
}

/// The reference, in ggml's generic `vec_dot_q5_0_q8_0` order of operations (candle's too), on the interleaved
/// layout: byte `t` of lane `k` in part `p` of a block is byte `4p + t` of row `k`'s ggml nibbles, whose low nibble is
/// value `4p + t` (fifth bit: bit `4k + t` of mask `p`) and high nibble value `4p + t + 16` (of mask `p + 4`).
fn group_scalar(w: Q5_0Group<'_>, ys: &[Q8Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    for (y, o) in ys.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let mut sum = 0f32;
            for b in 0..w.blocks() {
                let masks = &w.high[b * BLOCK_MASKS..(b + 1) * BLOCK_MASKS];
                let fifth = |part: usize, t: usize| fifth_bits::scalar(masks, part, (k, t)) as i32;
                let mut sumi = 0i32;
                for p in 0..4 {
                    for t in 0..4 {
                        let q = w.qs[b * BLOCK_QS + p * PART_BYTES + 4 * k + t];
                        let j = 4 * p + t;
                        let low = ((q & 0x0F) as i32 | fifth(p, t)) - 16;
                        let high = ((q >> 4) as i32 | fifth(p + 4, t)) - 16;
                        sumi += low * y.qs[b][j] as i32 + high * y.qs[b][j + 16] as i32;
                    }
                }
                sum += sumi as f32 * w.d[b * GROUP_ROWS + k].to_f32() * y.d[b];
            }
            *o = sum;
        }
    }
}

/// Eight lanes (weight rows) per vector: the group in two halves, each half's fifth bits the half of every mask
/// that covers its lanes, spread to bytes.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::super::fifth_bits::spread_avx2;
    use super::{Q5_0Group, Q8Row, BLOCK_MASKS, BLOCK_QS, GROUP_ROWS, PART_BYTES};
    use crate::compute::linear::prefetch_ahead;
    use std::arch::x86_64::*;

    /// Lanes per vector.
    const LANES: usize = 8;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q5_0Group<'_>, ys: &[Q8Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        by_tiles!(tile, 8, w, ys, out)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const N: usize>(
        w: Q5_0Group<'_>,
        ys: &[Q8Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let qs: [*const i32; N] = std::array::from_fn(|r| ys[r].qs.as_ptr() as *const i32);
        for half in 0..GROUP_ROWS / LANES {
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..w.blocks() {
                let base = w.qs.as_ptr().add(b * BLOCK_QS + half * 4 * LANES);
                if N > 1 && half == 0 {
                    prefetch_ahead(w.qs.as_ptr(), b, BLOCK_QS);
                }
                let high = w.high.as_ptr().add(b * BLOCK_MASKS);
                let mut q = [_mm256_setzero_si256(); 8];
                for p in 0..4 {
                    let packed = _mm256_loadu_si256(base.add(p * PART_BYTES) as *const __m256i);
                    let bits = |part: usize| spread_avx2((*high.add(part) >> (32 * half)) as u32);
                    q[p] = _mm256_or_si256(_mm256_and_si256(packed, mask), bits(p));
                    q[p + 4] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask),
                        bits(p + 4),
                    );
                }
                let wd = _mm256_cvtph_ps(_mm_loadu_si128(
                    w.d.as_ptr().add(b * GROUP_ROWS + half * LANES) as *const __m128i,
                ));
                each_row!(N, |r| {
                    // A pair of products is at most 2 * 31 * 127 = 7,874, four parts' pairs 31,496: exact in 16
                    // bits, widened once per four parts.
                    let y = qs[r].add(b * 8);
                    let part = |p: usize| {
                        _mm256_maddubs_epi16(q[p], _mm256_set1_epi32(y.add(p).read_unaligned()))
                    };
                    let lo = _mm256_add_epi16(
                        _mm256_add_epi16(part(0), part(1)),
                        _mm256_add_epi16(part(2), part(3)),
                    );
                    let hi = _mm256_add_epi16(
                        _mm256_add_epi16(part(4), part(5)),
                        _mm256_add_epi16(part(6), part(7)),
                    );
                    let dot =
                        _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
                    let row = &ys[r];
                    let sumi =
                        _mm256_sub_epi32(dot, _mm256_set1_epi32(16 * *row.sum.get_unchecked(b)));
                    let term = _mm256_mul_ps(
                        _mm256_mul_ps(_mm256_cvtepi32_ps(sumi), wd),
                        _mm256_set1_ps(*row.d.get_unchecked(b)),
                    );
                    acc[r] = _mm256_add_ps(acc[r], term);
                });
            }
            for r in 0..N {
                _mm256_storeu_ps(out[r].as_mut_ptr().add(half * LANES), acc[r]);
            }
        }
    }
}

/// Sixteen lanes per vector: the whole group at once, each part's fifth bits added by one masked add.
#[cfg(target_arch = "x86_64")]
mod avx512_vnni {
    use super::{Q5_0Group, Q8Row, BLOCK_MASKS, BLOCK_QS, GROUP_ROWS, PART_BYTES};
    use crate::compute::linear::{block_dot_512, prefetch_ahead};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q5_0Group<'_>, ys: &[Q8Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        by_wide_tiles!(tile, w, ys, out)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const N: usize>(
        w: Q5_0Group<'_>,
        ys: &[Q8Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let mask = _mm512_set1_epi8(0x0F);
        let fifth = _mm512_set1_epi8(0x10);
        let qs: [*const i32; N] = std::array::from_fn(|r| ys[r].qs.as_ptr() as *const i32);
        let ds: [*const f32; N] = std::array::from_fn(|r| ys[r].d.as_ptr());
        let sums: [*const i32; N] = std::array::from_fn(|r| ys[r].sum.as_ptr());
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..w.blocks() {
            let base = w.qs.as_ptr().add(b * BLOCK_QS);
            if N > 1 {
                prefetch_ahead(w.qs.as_ptr(), b, BLOCK_QS);
            }
            let high = w.high.as_ptr().add(b * BLOCK_MASKS);
            let mut q = [_mm512_setzero_si512(); 8];
            for p in 0..4 {
                let packed = _mm512_loadu_si512(base.add(p * PART_BYTES) as *const __m512i);
                let low = _mm512_and_si512(packed, mask);
                q[p] = _mm512_mask_add_epi8(low, *high.add(p), low, fifth);
                let top = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
                q[p + 4] = _mm512_mask_add_epi8(top, *high.add(p + 4), top, fifth);
            }
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(
                w.d.as_ptr().add(b * GROUP_ROWS) as *const __m256i
            ));
            each_row!(N, |r| {
                let sumi = _mm512_sub_epi32(
                    block_dot_512(&q, qs[r].add(b * 8)),
                    _mm512_set1_epi32(16 * *sums[r].add(b)),
                );
                let term = _mm512_mul_ps(
                    _mm512_mul_ps(_mm512_cvtepi32_ps(sumi), wd),
                    _mm512_set1_ps(*ds[r].add(b)),
                );
                acc[r] = _mm512_add_ps(acc[r], term);
            });
        }
        for r in 0..N {
            _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
        }
    }
}

//! [`Summation::Blocks`](super::Summation::Blocks): each block's products summed exactly in integers, then
//! `acc += (d_w * d_x) * sum` (fused), block after block. Every kernel gives the scalar reference bit for bit.
use super::{Q8_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, PART_BYTES, QK8_0};

/// The reference.
pub(super) fn group_scalar(w: Q8_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for b in 0..w.blocks() {
                let d = w.d[b * GROUP_ROWS + k].to_f32() * x.d[b];
                let sum: i32 = (0..QK8_0 / 4)
                    .map(|l| {
                        let at = b * BLOCK_QS + l * PART_BYTES + 4 * k;
                        (0..4)
                            .map(|t| w.qs[at + t] as i32 * x.qs[b][4 * l + t] as i32)
                            .sum::<i32>()
                    })
                    .sum();
                acc = d.mul_add(sum as f32, acc);
            }
            *o = acc;
        }
    }
}

/// Eight lanes (weight rows) per vector: the group in two halves. Activation rows go up to [`TILE`](avx2::TILE) at
/// a time, each weight vector loaded and its absolute value taken once for all of them, and each row's bytes and
/// scales read through plain pointers; a lone row (a decode step's head) goes by itself.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::{Q8_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, PART_BYTES, QK8_0};
    use crate::compute::linear::prefetch_ahead;
    use std::arch::x86_64::*;

    const LANES: usize = 8;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q8_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        by_tiles!(tile, TILE, w, xs, out, |w, xs, out| one_row(
            w,
            xs[0],
            &mut out[0]
        ))
    }

    /// Activation rows per tile: sixteen rows of the LM head 1.33-1.40x faster than one at a time, four at a time
    /// 1.31-1.34x (Zen 3, 2 threads). Their accumulators do not all fit the sixteen registers; the spills cost
    /// less than unpacking each weight vector twice as often.
    pub const TILE: usize = 8;

    // `r` picks each row's pointers, sums and accumulators alike.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const N: usize>(
        w: Q8_0Group<'_>,
        xs: &[Q8_0Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let ones = _mm256_set1_epi16(1);
        let xq: [*const i32; N] = std::array::from_fn(|r| xs[r].qs.as_ptr() as *const i32);
        let xd: [*const f32; N] = std::array::from_fn(|r| xs[r].d.as_ptr());
        for half in 0..GROUP_ROWS / LANES {
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..w.blocks() {
                // As in the 512-bit kernel: the head's weights come from memory, and several rows compute long
                // enough per block for them to arrive late; the first half's pass brings each block in.
                if half == 0 {
                    prefetch_ahead(w.qs.as_ptr(), b, BLOCK_QS);
                }
                let at = b * GROUP_ROWS + half * LANES;
                let wd = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(at) as *const __m128i));
                let base = w.qs.as_ptr().add(b * BLOCK_QS + half * 4 * LANES);
                let mut sums = [_mm256_setzero_si256(); N];
                for l in 0..QK8_0 / 4 {
                    let bw = _mm256_loadu_si256(base.add(l * PART_BYTES) as *const __m256i);
                    let aw = _mm256_sign_epi8(bw, bw);
                    each_row!(N, |r| {
                        let bx = _mm256_set1_epi32(xq[r].add(b * 8 + l).read_unaligned());
                        let products = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bx, bw));
                        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(ones, products));
                    });
                }
                each_row!(N, |r| {
                    let d = _mm256_mul_ps(wd, _mm256_set1_ps(*xd[r].add(b)));
                    acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums[r]), acc[r]);
                });
            }
            for r in 0..N {
                _mm256_storeu_ps(out[r].as_mut_ptr().add(half * LANES), acc[r]);
            }
        }
    }

    /// One activation row, each block's scale product formed before its sums (a tile of one measured slower).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one_row(w: Q8_0Group<'_>, x: Q8_0Row<'_>, o: &mut [f32; GROUP_ROWS]) {
        let ones = _mm256_set1_epi16(1);
        for half in 0..GROUP_ROWS / LANES {
            let mut acc = _mm256_setzero_ps();
            for b in 0..w.blocks() {
                let at = b * GROUP_ROWS + half * LANES;
                let wd = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(at) as *const __m128i));
                let d = _mm256_mul_ps(wd, _mm256_set1_ps(x.d[b]));
                let base = w.qs.as_ptr().add(b * BLOCK_QS + half * 4 * LANES);
                let xq = x.qs.as_ptr().add(b) as *const i32;
                let mut sums = _mm256_setzero_si256();
                for l in 0..QK8_0 / 4 {
                    let bw = _mm256_loadu_si256(base.add(l * PART_BYTES) as *const __m256i);
                    let bx = _mm256_set1_epi32(xq.add(l).read_unaligned());
                    // Signed bytes times signed bytes: the weight's sign moves onto the activation.
                    let products =
                        _mm256_maddubs_epi16(_mm256_sign_epi8(bw, bw), _mm256_sign_epi8(bx, bw));
                    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(ones, products));
                }
                acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), acc);
            }
            _mm256_storeu_ps(o.as_mut_ptr().add(half * LANES), acc);
        }
    }
}

/// Sixteen lanes per vector: the whole group, up to [`TILE`](avx512_vnni::TILE) activation rows at a time, each
/// weight vector loaded and offset once for all of them.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512_vnni {
    use super::{Q8_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, PART_BYTES, QK8_0};
    use crate::compute::linear::{prefetch_ahead, prefetch_far};
    use std::arch::x86_64::*;

    /// Activation rows per tile: their accumulators and a block's eight weight vectors take sixteen of the
    /// thirty-two registers.
    pub const TILE: usize = 8;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q8_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        by_tiles!(tile, TILE, w, xs, out)
    }

    // `r` picks each row's activations, sum and output alike.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const N: usize>(
        w: Q8_0Group<'_>,
        xs: &[Q8_0Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..w.blocks() {
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(
                w.d.as_ptr().add(b * GROUP_ROWS) as *const __m256i
            ));
            let base = w.qs.as_ptr().add(b * BLOCK_QS);
            // With several rows the tile computes long enough per block for the weights to arrive late: fetch a
            // few blocks ahead (an LM head's 30 MB come from memory; 10% faster for 16 rows). A lone row streams
            // fast enough that the hardware prefetcher keeps up, and the hints only cost it.
            if N > 1 {
                prefetch_ahead(w.qs.as_ptr(), b, BLOCK_QS);
                prefetch_far(w.qs.as_ptr(), b, BLOCK_QS);
            }
            // `dpbusd` takes unsigned weights: w + 128 (the sign bit flipped), and each row's sum starts at
            // -128 * sum(x) to take the offset back out, so it ends as the block's exact signed sum.
            let bw: [__m512i; QK8_0 / 4] = std::array::from_fn(|l| {
                _mm512_xor_si512(
                    _mm512_loadu_si512(base.add(l * PART_BYTES) as *const __m512i),
                    flip,
                )
            });
            each_row!(N, |r| {
                let xq = xs[r].qs.as_ptr().add(b) as *const i32;
                // Two chains of four, so a row's products do not wait on one another; written out row by row
                // (`each_row!`), so the accumulators stay in registers.
                let mut lo = _mm512_set1_epi32(xs[r].block_offset[b]);
                let mut hi = _mm512_setzero_si512();
                for l in 0..QK8_0 / 8 {
                    lo = _mm512_dpbusd_epi32(
                        lo,
                        bw[l],
                        _mm512_set1_epi32(xq.add(l).read_unaligned()),
                    );
                    hi = _mm512_dpbusd_epi32(
                        hi,
                        bw[l + 4],
                        _mm512_set1_epi32(xq.add(l + 4).read_unaligned()),
                    );
                }
                let d = _mm512_mul_ps(wd, _mm512_set1_ps(xs[r].d[b]));
                acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), acc[r]);
            });
        }
        for r in 0..N {
            _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
        }
    }
}

/// Sixteen activation rows at a time on AMX: a tile multiply gives a block's sixteen rows' exact sums for the
/// group's sixteen weight rows, straight from the repacked weights (whose parts are already the tile's layout, and
/// signed, so no offset is needed), and the vector pipes form only `(d_w * d_x) * sum`; the next block's product is
/// started before this block's float terms. Fewer rows, or rows not evenly spaced, take the 512-bit kernel.
#[cfg(target_arch = "x86_64")]
pub(super) mod amx {
    use super::super::super::amx::{by_tiles, configure_thread, signed_by_signed, TILE_ROWS};
    use super::{Q8_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, QK8_0};
    use crate::compute::linear::prefetch_ahead;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// Two blocks' sums: the one being read and the one being computed, each row (activation row) holding the
    /// group's sixteen weight rows.
    #[repr(C, align(64))]
    struct Sums([[i32; TILE_ROWS * GROUP_ROWS]; 2]);

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q8_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        // SAFETY (both): the caller's CPU has AMX and AVX-512 VNNI; lengths were checked by `Kernel::group_dots`.
        by_tiles(
            xs,
            out,
            |x| x.qs.as_ptr() as usize,
            |rows, stride, out| unsafe { tile(w, rows, stride, out) },
            |rows, out| unsafe { super::avx512_vnni::group_dots(w, rows, out) },
        );
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile(
        w: Q8_0Group<'_>,
        xs: &[Q8_0Row<'_>],
        stride: usize,
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        configure_thread();
        // Left uninitialised (zeroing it cost as much as a tenth of the kernel): each block's sums are stored by
        // its tile product before they are read.
        let mut sums = MaybeUninit::<Sums>::uninit();
        let sums = sums.as_mut_ptr().cast::<[i32; TILE_ROWS * GROUP_ROWS]>();
        let (a, weights) = (xs[0].qs.as_ptr() as *const i8, w.qs.as_ptr());
        let nb = w.blocks();
        signed_by_signed(a, stride, weights, sums.cast());
        let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
        for b in 0..nb {
            let k = b & 1;
            // A tile load waits for its data, and the head's weights come from memory.
            prefetch_ahead(weights, b, BLOCK_QS);
            if b + 1 < nb {
                let next = (a.add((b + 1) * QK8_0), weights.add((b + 1) * BLOCK_QS));
                signed_by_signed(next.0, stride, next.1, sums.add(k ^ 1).cast());
            }
            let block = sums.add(k).cast::<i32>().cast_const();
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(
                w.d.as_ptr().add(b * GROUP_ROWS) as *const __m256i
            ));
            for (r, acc) in acc.iter_mut().enumerate() {
                let sum = _mm512_load_si512(block.add(r * GROUP_ROWS) as *const __m512i);
                let d = _mm512_mul_ps(wd, _mm512_set1_ps(xs[r].d[b]));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), *acc);
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), acc);
        }
    }
}

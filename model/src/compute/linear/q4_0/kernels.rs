//! The Q4_0 dot products: a scalar reference in candle's order of operations and vector kernels that give it bit
//! for bit, chosen at run time.
use super::super::q8_0::{hsum_lanes, Q8_0Row};
use super::super::{GROUP_ROWS, PART_BYTES};
use super::{Q4_0Group, BLOCK_QS, QK4_0};

pub use super::super::VectorKernel as Kernel;

/// `out[r][k] = dot(row k of w, xs[r])` for every activation row, each as long as `w`'s rows.
pub fn group_dots(
    kernel: Kernel,
    w: Q4_0Group<'_>,
    xs: &[Q8_0Row<'_>],
    out: &mut [[f32; GROUP_ROWS]],
) {
    let nb = w.blocks();
    assert!(
        xs.iter()
            .all(|x| x.d.len() == nb && x.qs.len() == nb && x.offset.len() == nb)
            && out.len() >= xs.len()
    );
    match kernel {
        Kernel::Scalar => group_scalar(w, xs, out),
        // SAFETY (both): `available` lists a kernel only on CPUs with its features; lengths were checked above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::group_dots(w, xs, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => unsafe { avx512_vnni::group_dots(w, xs, out) },
    }
}

/// Weight `4l + t` of row `k` in block `b` (its nibble, 0..16): lanes 0-3 are the parts' low nibbles, lanes 4-7
/// their high ones.
fn nibble(w: Q4_0Group<'_>, b: usize, l: usize, k: usize, t: usize) -> u8 {
    let byte = w.qs[b * BLOCK_QS + (l % 4) * PART_BYTES + 4 * k + t];
    if l < 4 {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

/// Candle's AVX2 `vec_dot_q4_0_q8_0` in scalar code: lane `l` sums the products of values `4l..4l + 4` (weights
/// `q - 8`), each block adds `d_w * d_x * lane` to the lane's running sum (fused), and the lanes are summed as
/// `hsum_float_8` does.
fn group_scalar(w: Q4_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let mut acc = [0f32; QK4_0 / 4];
            for b in 0..w.blocks() {
                let d = w.d[b * GROUP_ROWS + k].to_f32() * x.d[b];
                for (l, a) in acc.iter_mut().enumerate() {
                    let sumi: i32 = (0..4)
                        .map(|t| (nibble(w, b, l, k, t) as i32 - 8) * x.qs[b][4 * l + t] as i32)
                        .sum();
                    *a = d.mul_add(sumi as f32, *a);
                }
            }
            *o = hsum_lanes(acc);
        }
    }
}

/// Eight lanes (weight rows) per vector: the group in two halves, one activation row at a time (its eight sums per
/// row take eight registers). Each part's 32 bytes give two lanes' weights, its low and high nibbles.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::super::q8_0::avx2::{add_lane, hsum};
    use super::{Q4_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, PART_BYTES};
    use std::arch::x86_64::*;

    const LANES: usize = 8;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q4_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        let (mask, eight) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(8));
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            for half in 0..GROUP_ROWS / LANES {
                let mut acc = [_mm256_setzero_ps(); 8];
                for b in 0..w.blocks() {
                    let at = b * GROUP_ROWS + half * LANES;
                    let wd =
                        _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(at) as *const __m128i));
                    let d = _mm256_mul_ps(wd, _mm256_set1_ps(x.d[b]));
                    let base = w.qs.as_ptr().add(b * BLOCK_QS + half * 4 * LANES);
                    let xq = x.qs.as_ptr().add(b) as *const i32;
                    for p in 0..4 {
                        let packed = _mm256_loadu_si256(base.add(p * PART_BYTES) as *const __m256i);
                        let low = _mm256_and_si256(packed, mask);
                        let high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
                        for (l, nibbles) in [(p, low), (p + 4, high)] {
                            let bw = _mm256_sub_epi8(nibbles, eight);
                            acc[l] = add_lane(acc[l], d, bw, xq.add(l).read_unaligned());
                        }
                    }
                }
                _mm256_storeu_ps(o.as_mut_ptr().add(half * LANES), hsum(&acc));
            }
        }
    }
}

/// Sixteen lanes per vector: the whole group, two activation rows at a time (sixteen of the thirty-two registers
/// hold their sums; each block's weights are unpacked once for both).
#[cfg(target_arch = "x86_64")]
mod avx512_vnni {
    use super::super::super::q8_0::avx512_vnni::{add_lane, store_lanes};
    use super::{Q4_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, PART_BYTES};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q4_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        let pairs = xs.len() / 2;
        for i in (0..2 * pairs).step_by(2) {
            tile::<2>(w, &xs[i..i + 2], &mut out[i..i + 2]);
        }
        if xs.len() % 2 == 1 {
            let last = xs.len() - 1;
            tile::<1>(w, &xs[last..], &mut out[last..]);
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const N: usize>(
        w: Q4_0Group<'_>,
        xs: &[Q8_0Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let mask = _mm512_set1_epi8(0x0F);
        // `dpbusd` takes unsigned weights: `q - 8 + 128`, and each row's sum starts at its `-128 * sum(x)`, so a
        // lane holds the exact signed sum.
        let offset = _mm512_set1_epi8(120);
        let mut acc = [[_mm512_setzero_ps(); 8]; N];
        for b in 0..w.blocks() {
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(
                w.d.as_ptr().add(b * GROUP_ROWS) as *const __m256i
            ));
            let d: [__m512; N] =
                std::array::from_fn(|r| _mm512_mul_ps(wd, _mm512_set1_ps(xs[r].d[b])));
            let base = w.qs.as_ptr().add(b * BLOCK_QS);
            let mut bw = [_mm512_setzero_si512(); 8];
            for p in 0..4 {
                let packed = _mm512_loadu_si512(base.add(p * PART_BYTES) as *const __m512i);
                bw[p] = _mm512_add_epi8(_mm512_and_si512(packed, mask), offset);
                bw[p + 4] =
                    _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(packed, 4), mask), offset);
            }
            for (l, &bw) in bw.iter().enumerate() {
                add_lane(&mut acc, &d, bw, (xs, b, l));
            }
        }
        store_lanes(&acc, out);
    }
}

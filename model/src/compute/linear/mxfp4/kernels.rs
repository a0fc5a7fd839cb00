//! The MXFP4 dot products: a scalar reference in the order of ggml's AVX2 `ggml_vec_dot_mxfp4_q8_0` and an AVX2
//! kernel that gives it bit for bit, chosen at run time.
//!
//! That order, for one weight row against one activation row: eight float lanes, lane `l` taking the exact
//! integer sum of the products of values `4l..4l + 4` of a block; the blocks in pairs, the first of each pair
//! adding `d * lane` (fused) to one set of lanes and the second to another, `d` being the weight's
//! [`e8m0_half`](super::e8m0_half) times the activation block's scale; then the two sets added lane by lane and
//! the eight lanes summed as ggml's `hsum_float_8`; and last, for an odd count of blocks, the last block's exact
//! integer sum added as `d * sum` (fused: how a compiler that contracts, GCC and Clang by default, builds ggml's
//! scalar tail). Read from ggml's source as we remember it, not checked against a ggml build here.
//!
//! The AVX-512 VNNI kernel forms the same exact integer lane sums with `dpbusd` (weights looked up offset by 128,
//! unsigned, the activations' row offsets taking it back out), sixteen rows a vector, and adds them in the same
//! float order: the three kernels agree bit for bit.
use super::super::q8_0::{hsum_lanes, Q8_0Row};
use super::super::{GROUP_ROWS, PART_BYTES};
use super::{e8m0_half, Mxfp4Group, BLOCK_QS, KVALUES, QK_MXFP4};

pub use super::super::VectorKernel as Kernel;

/// `out[r][k] = dot(row k of w, xs[r])` for every activation row, each as long as `w`'s rows.
pub fn group_dots(
    kernel: Kernel,
    w: Mxfp4Group<'_>,
    xs: &[Q8_0Row<'_>],
    out: &mut [[f32; GROUP_ROWS]],
) {
    let nb = w.blocks();
    assert!(
        xs.iter().all(|x| x.d.len() == nb && x.qs.len() == nb)
            && w.qs.len() == nb * BLOCK_QS
            && out.len() >= xs.len()
    );
    match kernel {
        Kernel::Scalar => group_scalar(w, xs, out),
        // SAFETY: `available` lists a kernel only on CPUs with its features (`cpu_features`); lengths were checked
        // above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::group_dots(w, xs, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => unsafe { avx512_vnni::group_dots(w, xs, out) },
    }
}

/// Weight `4l + t` of row `k` in block `b` as its integer [`KVALUES`] entry: lanes 0-3 are the parts' low
/// nibbles, lanes 4-7 their high ones.
fn weight(w: Mxfp4Group<'_>, b: usize, l: usize, k: usize, t: usize) -> i32 {
    let byte = w.qs[b * BLOCK_QS + (l % 4) * PART_BYTES + 4 * k + t];
    let q = if l < 4 { byte & 0x0F } else { byte >> 4 };
    KVALUES[usize::from(q)] as i32
}

/// The exact sum of the products of lane `l` of block `b` of row `k` and the activations `x`.
fn lane_sum(w: Mxfp4Group<'_>, x: &Q8_0Row<'_>, (b, l, k): (usize, usize, usize)) -> i32 {
    (0..4)
        .map(|t| weight(w, b, l, k, t) * x.qs[b][4 * l + t] as i32)
        .sum()
}

/// The reference: ggml's AVX2 order (the module docs) in scalar code.
fn group_scalar(w: Mxfp4Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    let nb = w.blocks();
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let mut acc = [[0f32; QK_MXFP4 / 4]; 2];
            for b in 0..nb / 2 * 2 {
                let d = e8m0_half(w.e[b * GROUP_ROWS + k]) * x.d[b];
                for (l, a) in acc[b % 2].iter_mut().enumerate() {
                    *a = d.mul_add(lane_sum(w, x, (b, l, k)) as f32, *a);
                }
            }
            let mut sum = hsum_lanes(std::array::from_fn(|l| acc[0][l] + acc[1][l]));
            if nb % 2 == 1 {
                let b = nb - 1;
                let d = e8m0_half(w.e[b * GROUP_ROWS + k]) * x.d[b];
                let sumi: i32 = (0..QK_MXFP4 / 4).map(|l| lane_sum(w, x, (b, l, k))).sum();
                sum = d.mul_add(sumi as f32, sum);
            }
            *o = sum;
        }
    }
}

/// Eight lanes (weight rows) per vector: the group in two halves, one activation row at a time. Each part's 32
/// bytes give two lanes' weights, its low and high nibbles, looked up in [`KVALUES`] by a byte shuffle.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::super::q8_0::avx2::{add_lane, hsum};
    use super::{Mxfp4Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, KVALUES, PART_BYTES};
    use std::arch::x86_64::*;

    const LANES: usize = 8;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Mxfp4Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        let nb = w.blocks();
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            for half in 0..GROUP_ROWS / LANES {
                let mut even = [_mm256_setzero_ps(); 8];
                let mut odd = [_mm256_setzero_ps(); 8];
                for b in (0..nb / 2 * 2).step_by(2) {
                    add_block(&mut even, (w, table), x, (b, half));
                    add_block(&mut odd, (w, table), x, (b + 1, half));
                }
                let both: [__m256; 8] = std::array::from_fn(|l| _mm256_add_ps(even[l], odd[l]));
                let mut sum = hsum(&both);
                if nb % 2 == 1 {
                    let b = nb - 1;
                    let weights = block_weights(w, table, (b, half));
                    let xq = x.qs.as_ptr().add(b) as *const i32;
                    let mut sumi = _mm256_setzero_si256();
                    for (l, &bw) in weights.iter().enumerate() {
                        sumi = _mm256_add_epi32(sumi, lane_sums(bw, xq.add(l).read_unaligned()));
                    }
                    sum = _mm256_fmadd_ps(
                        scales(w, (b, half), x.d[b]),
                        _mm256_cvtepi32_ps(sumi),
                        sum,
                    );
                }
                _mm256_storeu_ps(o.as_mut_ptr().add(half * LANES), sum);
            }
        }
    }

    /// Block `b` of the half's rows against activation row `x`, added to `acc` lane by lane (`d * sum`, fused).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add_block(
        acc: &mut [__m256; 8],
        (w, table): (Mxfp4Group<'_>, __m256i),
        x: &Q8_0Row<'_>,
        (b, half): (usize, usize),
    ) {
        let d = scales(w, (b, half), x.d[b]);
        let xq = x.qs.as_ptr().add(b) as *const i32;
        for (l, &bw) in block_weights(w, table, (b, half)).iter().enumerate() {
            acc[l] = add_lane(acc[l], d, bw, xq.add(l).read_unaligned());
        }
    }

    /// Block `b`'s weights of the half's eight rows as signed bytes, by lane: part `p`'s low nibbles are lane `p`
    /// (values `4p..4p + 4`), its high ones lane `p + 4`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_weights(
        w: Mxfp4Group<'_>,
        table: __m256i,
        (b, half): (usize, usize),
    ) -> [__m256i; 8] {
        let mask = _mm256_set1_epi8(0x0F);
        let base = w.qs.as_ptr().add(b * BLOCK_QS + half * 4 * LANES);
        let mut bw = [_mm256_setzero_si256(); 8];
        for p in 0..4 {
            let packed = _mm256_loadu_si256(base.add(p * PART_BYTES) as *const __m256i);
            // Indices below 16 (the high bit clear): each byte takes its entry of the table in its 128-bit half.
            bw[p] = _mm256_shuffle_epi8(table, _mm256_and_si256(packed, mask));
            bw[p + 4] =
                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask));
        }
        bw
    }

    /// In each lane (weight row), the exact sum of the products of its four signed weight bytes in `bw` and the
    /// four signed activation bytes `x` (as [`add_lane`] forms them, before its float multiply-add).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lane_sums(bw: __m256i, x: i32) -> __m256i {
        let bx = _mm256_set1_epi32(x);
        // Weights of at most 12 in magnitude: a pair's products, at most 2 * 12 * 128, never saturate.
        let products = _mm256_maddubs_epi16(_mm256_sign_epi8(bw, bw), _mm256_sign_epi8(bx, bw));
        _mm256_madd_epi16(_mm256_set1_epi16(1), products)
    }

    /// Each of the half's rows' scale for block `b`, times the activation block's `xd`: the exponents widened to
    /// 32 bits and made floats by their bits, `(e - 1) << 23`, or for `e` 0 and 1 the subnormals `2^21 << e` (as
    /// [`e8m0_half`](super::e8m0_half)).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(w: Mxfp4Group<'_>, (b, half): (usize, usize), xd: f32) -> __m256 {
        let at = w.e.as_ptr().add(b * GROUP_ROWS + half * LANES);
        let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const __m128i));
        let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        let subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        let bits = _mm256_blendv_epi8(normal, subnormal, small);
        _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(xd))
    }
}

/// Sixteen lanes (the whole group) per vector, one activation row at a time: even and odd blocks in their own
/// eight accumulators, as the AVX2 kernel's halves.
#[cfg(target_arch = "x86_64")]
mod avx512_vnni {
    use super::super::super::q8_0::avx512_vnni::{add_lane, store_lanes};
    use super::{Mxfp4Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, KVALUES, PART_BYTES};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Mxfp4Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        // The table's entries plus 128, as the unsigned bytes `dpbusd` takes.
        let offset: [u8; 16] = KVALUES.map(|v| (v as u8) ^ 0x80);
        let table = _mm512_broadcast_i32x4(_mm_loadu_si128(offset.as_ptr() as *const __m128i));
        let nb = w.blocks();
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            let row = std::slice::from_ref(x);
            let mut acc = [[[_mm512_setzero_ps(); 8]; 1]; 2];
            for b in 0..nb / 2 * 2 {
                let d = [scales(w, b, x.d[b])];
                for (l, bw) in block_weights(w, table, b).into_iter().enumerate() {
                    add_lane(&mut acc[b % 2], &d, bw, (row, b, l));
                }
            }
            let both = [std::array::from_fn(|l| {
                _mm512_add_ps(acc[0][0][l], acc[1][0][l])
            })];
            store_lanes(&both, std::slice::from_mut(o));
            if nb % 2 == 1 {
                let b = nb - 1;
                let xq = x.qs.as_ptr().add(b) as *const i32;
                let mut sumi = _mm512_setzero_si512();
                for (l, bw) in block_weights(w, table, b).into_iter().enumerate() {
                    let lane = _mm512_dpbusd_epi32(
                        _mm512_set1_epi32(x.offset[b][l]),
                        bw,
                        _mm512_set1_epi32(xq.add(l).read_unaligned()),
                    );
                    sumi = _mm512_add_epi32(sumi, lane);
                }
                let sum = _mm512_loadu_ps(o.as_ptr());
                let sum = _mm512_fmadd_ps(scales(w, b, x.d[b]), _mm512_cvtepi32_ps(sumi), sum);
                _mm512_storeu_ps(o.as_mut_ptr(), sum);
            }
        }
    }

    /// Block `b`'s weights of the group's sixteen rows, offset by 128, by lane: part `p`'s low nibbles are lane
    /// `p`, its high ones lane `p + 4`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn block_weights(w: Mxfp4Group<'_>, table: __m512i, b: usize) -> [__m512i; 8] {
        let mask = _mm512_set1_epi8(0x0F);
        let base = w.qs.as_ptr().add(b * BLOCK_QS);
        let mut bw = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            let packed = _mm512_loadu_si512(base.add(p * PART_BYTES) as *const __m512i);
            bw[p] = _mm512_shuffle_epi8(table, _mm512_and_si512(packed, mask));
            bw[p + 4] =
                _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask));
        }
        bw
    }

    /// Each row's scale for block `b` times the activation block's `xd`, built from the exponents' bits as the
    /// AVX2 kernel's `scales` builds them.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn scales(w: Mxfp4Group<'_>, b: usize, xd: f32) -> __m512 {
        let at = w.e.as_ptr().add(b * GROUP_ROWS);
        let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
        let normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        let subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
        let small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
        let bits = _mm512_mask_blend_epi32(small, normal, subnormal);
        _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(xd))
    }
}

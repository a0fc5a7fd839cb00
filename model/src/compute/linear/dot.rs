//! The Q4_1 x Q8_1 dot product: a scalar reference and AVX2 kernels chosen at run time.
//!
//! Candle computes this product with its generic scalar loop; it is most of a Q4_1 model's decode time. The AVX2
//! kernels follow ggml's `ggml_vec_dot_q4_1_q8_1` (nibbles widened to bytes, `maddubs` into 16-bit pairs, summed to
//! 32-bit lanes) over weights repacked by field ([`super::q4_1`]), so eight blocks' half-precision scales convert in
//! one instruction. Every kernel gives the reference's result bit for bit: integer sums are exact, and the float
//! terms are formed and added in the reference's order.
use super::q4_1::Q4_1Row;
use super::q8_1::Q8Row;

/// The best kernel this CPU runs, detected once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Kernel {
    /// Every kernel this CPU can run (tests check each against the reference).
    pub fn available() -> Vec<Self> {
        let mut all = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            all.push(Kernel::Avx2);
            if is_x86_feature_detected!("avxvnni") {
                all.push(Kernel::AvxVnni);
            }
            if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                all.push(Kernel::Avx512Vnni);
            }
        }
        all
    }

    pub fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                    return Kernel::Avx512Vnni;
                }
                if is_x86_feature_detected!("avxvnni") {
                    return Kernel::AvxVnni;
                }
                return Kernel::Avx2;
            }
            Kernel::Scalar
        })
    }

    /// `out[r] = dot(w, ys[r])` for every activation row, each as long as `w`.
    pub fn dot_rows(self, w: Q4_1Row<'_>, ys: &[Q8Row<'_>], out: &mut [f32]) {
        assert!(ys.iter().all(|y| y.d.len() == w.d.len()) && out.len() >= ys.len());
        match self {
            Kernel::Scalar => {
                for (o, y) in out.iter_mut().zip(ys) {
                    *o = dot_scalar(w, *y);
                }
            }
            // SAFETY (all three): `detect` chose the kernel only after checking the CPU has its features; lengths
            // were checked above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::dot_rows(w, ys, out) },
            #[cfg(target_arch = "x86_64")]
            Kernel::AvxVnni => unsafe { avx_vnni::dot_rows(w, ys, out) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => unsafe { avx512_vnni::dot_rows(w, ys, out) },
        }
    }
}

/// The reference, in ggml's generic `vec_dot_q4_1_q8_1` order of operations (candle's too).
pub fn dot_scalar(w: Q4_1Row<'_>, y: Q8Row<'_>) -> f32 {
    dot_scalar_from(0.0, w, y)
}

fn dot_scalar_from(mut sum: f32, w: Q4_1Row<'_>, y: Q8Row<'_>) -> f32 {
    for i in 0..w.d.len() {
        let mut sumi = 0i32;
        for j in 0..16 {
            let lo = (w.qs[i][j] & 0x0F) as i32;
            let hi = (w.qs[i][j] >> 4) as i32;
            sumi += lo * y.qs[i][j] as i32 + hi * y.qs[i][j + 16] as i32;
        }
        sum += sumi as f32 * w.d[i].to_f32() * y.d[i] + w.m[i].to_f32() * y.s[i];
    }
    sum
}

/// Eight float lanes summed in the order of an AVX2 horizontal sum (`_mm256` halves, then pairs, then the two
/// left), for scalar code that reproduces a vector kernel's result.
pub(crate) fn hsum_lanes(a: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| a[i + 4] + a[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// The x86 kernels, one module per instruction set; they differ only in how the byte products are summed.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_kernel {
    ($module:ident, $features:literal, |$qx:ident, $qy:ident| $products:block) => {
        mod $module {
            use super::{Q4_1Row, Q8Row};
            use std::arch::x86_64::*;

            /// Blocks whose scales are converted together.
            const GROUP: usize = 8;

            #[target_feature(enable = $features)]
            pub unsafe fn dot_rows(w: Q4_1Row<'_>, ys: &[Q8Row<'_>], out: &mut [f32]) {
                // Four activation rows share each unpacked weight block: weights are read once per four rows.
                let mut r = 0;
                while r + 4 <= ys.len() {
                    let o = dot_n::<4>(w, [ys[r], ys[r + 1], ys[r + 2], ys[r + 3]]);
                    out[r..r + 4].copy_from_slice(&o);
                    r += 4;
                }
                while r < ys.len() {
                    out[r] = dot_n::<1>(w, [ys[r]])[0];
                    r += 1;
                }
            }

            /// Eight 32-bit sums of products of unsigned weight bytes and signed activation bytes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn products($qx: __m256i, $qy: __m256i) -> __m256i {
                $products
            }

            /// Dots of one weight row with `N` activation rows. Eight blocks at a time: their integer sums (exact)
            /// are reduced into one vector, their terms `sumi * d_w * d_y + m_w * s_y` computed in the reference's
            /// order of operations (no fused multiply-add), then added to the row's sum in block order, so the
            /// result is the reference's bit for bit.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot_n<const N: usize>(w: Q4_1Row<'_>, ys: [Q8Row<'_>; N]) -> [f32; N] {
                let nb = w.d.len();
                let mut out = [0f32; N];
                let mut i = 0;
                while i + GROUP <= nb {
                    let mut sums = [[_mm256_setzero_si256(); GROUP]; N];
                    for j in 0..GROUP {
                        let packed = _mm_loadu_si128(w.qs.as_ptr().add(i + j) as *const __m128i);
                        // Low nibbles become bytes 0..16, high nibbles bytes 16..32, the Q8_1 block's order.
                        let qx = _mm256_and_si256(
                            _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                            _mm256_set1_epi8(0x0F),
                        );
                        for r in 0..N {
                            let qy =
                                _mm256_loadu_si256(ys[r].qs.as_ptr().add(i + j) as *const __m256i);
                            sums[r][j] = products(qx, qy);
                        }
                    }
                    let wd =
                        _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(i) as *const __m128i));
                    let wm =
                        _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr().add(i) as *const __m128i));
                    for r in 0..N {
                        let sumi = _mm256_cvtepi32_ps(reduce8(&sums[r]));
                        let yd = _mm256_loadu_ps(ys[r].d.as_ptr().add(i));
                        let ysum = _mm256_loadu_ps(ys[r].s.as_ptr().add(i));
                        let terms = _mm256_add_ps(
                            _mm256_mul_ps(_mm256_mul_ps(sumi, wd), yd),
                            _mm256_mul_ps(wm, ysum),
                        );
                        let mut t = [0f32; GROUP];
                        _mm256_storeu_ps(t.as_mut_ptr(), terms);
                        for term in t {
                            out[r] += term;
                        }
                    }
                    i += GROUP;
                }
                // The last few blocks one at a time, in the same order of operations.
                while i < nb {
                    let packed = _mm_loadu_si128(w.qs.as_ptr().add(i) as *const __m128i);
                    let qx = _mm256_and_si256(
                        _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                        _mm256_set1_epi8(0x0F),
                    );
                    let (wd, wm) = (w.d[i].to_f32(), w.m[i].to_f32());
                    for r in 0..N {
                        let qy = _mm256_loadu_si256(ys[r].qs.as_ptr().add(i) as *const __m256i);
                        let sumi = hsum_epi32(products(qx, qy));
                        out[r] += sumi as f32 * wd * ys[r].d[i] + wm * ys[r].s[i];
                    }
                    i += 1;
                }
                out
            }

            /// The total of eight 32-bit lanes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn hsum_epi32(v: __m256i) -> i32 {
                let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
                _mm_cvtsi128_si32(s)
            }

            /// Eight vectors of eight partial sums to one vector of their eight totals.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn reduce8(v: &[__m256i; GROUP]) -> __m256i {
                let s01 = _mm256_hadd_epi32(v[0], v[1]);
                let s23 = _mm256_hadd_epi32(v[2], v[3]);
                let s45 = _mm256_hadd_epi32(v[4], v[5]);
                let s67 = _mm256_hadd_epi32(v[6], v[7]);
                let s0123 = _mm256_hadd_epi32(s01, s23);
                let s4567 = _mm256_hadd_epi32(s45, s67);
                // Each 128-bit half now holds one half's sums of blocks 0..4 (then 4..8): add the halves.
                _mm256_add_epi32(
                    _mm256_permute2x128_si256(s0123, s4567, 0x20),
                    _mm256_permute2x128_si256(s0123, s4567, 0x31),
                )
            }
        }
    };
}

// Nibbles are at most 15, so `maddubs`'s 16-bit pair sums (at most 2 * 15 * 128) never saturate.
#[cfg(target_arch = "x86_64")]
x86_kernel!(avx2, "avx2,fma,f16c", |qx, qy| {
    _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), _mm256_set1_epi16(1))
});
// VNNI sums four byte products straight into 32 bits: one instruction instead of two.
#[cfg(target_arch = "x86_64")]
x86_kernel!(avx_vnni, "avx2,fma,f16c,avxvnni", |qx, qy| {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), qx, qy)
});
#[cfg(target_arch = "x86_64")]
x86_kernel!(
    avx512_vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    |qx, qy| { _mm256_dpbusd_epi32(_mm256_setzero_si256(), qx, qy) }
);

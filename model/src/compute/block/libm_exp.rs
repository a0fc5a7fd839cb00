//! `f32::exp` eight lanes at a time, bit for bit what this process's libm gives.
//!
//! SwiGLU's SiLU takes one `exp` per value of the feed-forward's width, and through libm's scalar `expf` (a call
//! per value, about 5 ns) that was most of the op: 58 µs of a 16-row decode batch's 520–660 µs per block on two
//! cores.
//! glibc (2.27 on, x86-64 with FMA) computes `expf` in double precision: `x * 32 / ln 2 = k + r` by adding and
//! subtracting a shift, `2^(k/32)` from a 32-entry table, a cubic in `r`, and one rounding to f32 at the end. Every
//! step is one IEEE operation (the fused multiply-adds fused, as its FMA build has them), so the same operations on
//! vector lanes give the same bits. The table and coefficients are the algorithm's (ARM's optimized-routines, MIT,
//! as glibc ships them).
//!
//! A libm that computes otherwise (another C library, a build without FMA) gives other bits in some cases, so the
//! vector path is only taken once it matched this process's `f32::exp` on a sample across its whole range and every
//! table entry ([`vector_matches_libm`]); arguments outside it (`|x| >= 88`, NaN) always take the scalar `exp`.

/// `2^(i/32)` as f64 bits, less `i << 47` (added back with the exponent: see `exp_pd`).
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// `32 / ln 2`.
const INV_LN2_N: u64 = 0x40471547652b82fe;
/// `1.5 * 2^52`: adding it rounds to an integer, kept in the low bits.
const SHIFT: u64 = 0x4338000000000000;
/// The cubic's coefficients, highest first, scaled for `r` in units of 1/32.
const POLY: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];
/// Bits of the first |x| whose `exp` libm computes on its other path (88.0: overflow, underflow, NaN and infinity
/// beyond).
const SPECIAL_ABS_BITS: u32 = 0x42b0_0000;

/// The scalar form of the vector path, for [`vector_matches_libm`] and the tests: `exp(x)` for ordinary `x`.
fn exp_like_libm(x: f32) -> f32 {
    let f = f64::from_bits;
    let xd = f64::from(x);
    let shifted = f(INV_LN2_N).mul_add(xd, f(SHIFT));
    let ki = shifted.to_bits();
    let kd = shifted - f(SHIFT);
    let r = f(INV_LN2_N).mul_add(xd, -kd);
    let z = r.mul_add(f(POLY[0]), f(POLY[1]));
    let t = TABLE[(ki % 32) as usize].wrapping_add(ki << 47);
    let y = r.mul_add(f(POLY[2]), 1.0);
    let y = z.mul_add(r * r, y);
    (y * f64::from_bits(t)) as f32
}

/// Whether the vector path gives this process's `f32::exp` bit for bit: checked once (a few milliseconds), on some
/// 270 000 arguments spread over the ordinary range (every table entry many times over) and its edges.
pub fn vector_matches_libm() -> bool {
    static MATCHES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MATCHES.get_or_init(|| {
        let same = |x: f32| x.exp().to_bits() == exp_like_libm(x).to_bits();
        // Bit patterns from 0 up to the edge, both signs: all magnitudes, exponents and table entries alike.
        let sample = (0..SPECIAL_ABS_BITS)
            .step_by(8191)
            .chain([SPECIAL_ABS_BITS - 1]);
        let ok = sample
            .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
            .all(same);
        if !ok {
            tracing::info!("this libm's expf differs from glibc's: SiLU takes the scalar exp");
        }
        ok
    })
}

pub mod avx2 {
    use super::{POLY, SHIFT, SPECIAL_ABS_BITS, TABLE};
    use std::arch::x86_64::*;

    /// `exp` of four lanes, in f64 before the final rounding.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_pd(xd: __m256d) -> __m256d {
        let inv = _mm256_set1_pd(f64::from_bits(super::INV_LN2_N));
        let shift = _mm256_set1_pd(f64::from_bits(SHIFT));
        let shifted = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(shifted);
        let kd = _mm256_sub_pd(shifted, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let z = _mm256_fmadd_pd(
            r,
            _mm256_set1_pd(f64::from_bits(POLY[0])),
            _mm256_set1_pd(f64::from_bits(POLY[1])),
        );
        let index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        let t = _mm256_add_epi64(
            _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, index),
            _mm256_slli_epi64::<47>(ki),
        );
        let y = _mm256_fmadd_pd(
            r,
            _mm256_set1_pd(f64::from_bits(POLY[2])),
            _mm256_set1_pd(1.0),
        );
        let y = _mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y);
        _mm256_mul_pd(y, _mm256_castsi256_pd(t))
    }

    /// `exp` of eight lanes as libm computes each, or `None` when a lane is not ordinary (then call `exp` on each).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp8(x: __m256) -> Option<__m256> {
        let magnitude = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fff_ffff));
        let special = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(SPECIAL_ABS_BITS as i32 - 1));
        if _mm256_testz_si256(special, special) == 0 {
            return None;
        }
        let lo = _mm256_cvtpd_ps(exp_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
        let hi = _mm256_cvtpd_ps(exp_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x))));
        Some(_mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `x` takes the computation the vector path repeats.
    fn ordinary(x: f32) -> bool {
        x.to_bits() & 0x7fff_ffff < SPECIAL_ABS_BITS
    }

    /// Arguments across the ordinary range and its edges, both signs.
    fn arguments() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..SPECIAL_ABS_BITS)
            .step_by(997)
            .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
            .collect();
        xs.extend([
            0.0, -0.0, 1e-45, 87.99999, -87.99999, 1.0, -1.0, 0.5, 20.0, -20.0,
        ]);
        xs
    }

    #[test]
    fn the_scalar_form_is_libms_expf() {
        // On glibc with FMA (every x86-64 CI and dev machine here) this is the same computation; elsewhere the
        // vector path stays off, which `vector_matches_libm` says.
        let differing = arguments()
            .into_iter()
            .filter(|x| x.exp().to_bits() != exp_like_libm(*x).to_bits())
            .count();
        assert_eq!(differing == 0, vector_matches_libm());
        assert!(ordinary(87.99999) && !ordinary(88.0) && !ordinary(-f32::INFINITY));
        assert!(!ordinary(f32::NAN));
    }

    /// Every ordinary f32 (2^31 of them, some ten seconds): run by hand on a new libm or CPU,
    /// `cargo test --release -p petal-model --lib -- --ignored every_ordinary`.
    #[test]
    #[ignore]
    fn every_ordinary_argument_gives_libms_bits() {
        use rayon::prelude::*;
        let differing = (0..SPECIAL_ABS_BITS)
            .into_par_iter()
            .flat_map_iter(|b| [f32::from_bits(b), -f32::from_bits(b)])
            .filter(|x| x.exp().to_bits() != exp_like_libm(*x).to_bits())
            .count();
        assert_eq!(differing, 0);
    }

    #[test]
    fn eight_lanes_give_the_scalar_forms_bits() {
        if !crate::compute::linear::cpu_features().avx2 {
            return;
        }
        use std::arch::x86_64::*;
        for chunk in arguments().chunks_exact(8) {
            // SAFETY: AVX2 and FMA checked above; `chunk` has eight values.
            let got = unsafe {
                let v = avx2::exp8(_mm256_loadu_ps(chunk.as_ptr())).expect("ordinary arguments");
                let mut out = [0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), v);
                out
            };
            for (x, g) in chunk.iter().zip(got) {
                assert_eq!(g.to_bits(), exp_like_libm(*x).to_bits(), "exp({x})");
            }
        }
        // A lane at or past 88 sends the whole vector back to the scalar exp.
        let xs = [0.0f32, 1.0, 2.0, 88.0, 3.0, 4.0, 5.0, 6.0];
        // SAFETY: as above.
        assert!(unsafe { avx2::exp8(_mm256_loadu_ps(xs.as_ptr())) }.is_none());
    }
}

//! The vector operations the K-quant kernels use, over one row per 32-bit lane: sixteen rows in a 512-bit
//! register, eight in a 256-bit one. The kernels are written once over [`Lanes`]; each width's entry point enables
//! its CPU features and everything below it is inlined into it.
#![cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Integer and float vectors of [`Lanes::ROWS`] 32-bit lanes.
///
/// # Safety
/// Every method needs the CPU features of its width's entry point (AVX-512 F and BW, or AVX2, FMA and F16C) and
/// pointers valid for one vector's bytes.
pub trait Lanes: Copy {
    /// Rows per vector.
    const ROWS: usize;
    type I: Copy;
    type F: Copy;

    unsafe fn load(p: *const u8) -> Self::I;
    /// `ROWS` halves from `p`, as floats.
    unsafe fn halves(p: *const u8) -> Self::F;
    unsafe fn store(p: *mut f32, v: Self::F);

    unsafe fn zero() -> Self::I;
    unsafe fn splat8(v: i8) -> Self::I;
    unsafe fn splat32(v: i32) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add32(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub16(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn shl16(a: Self::I, n: i32) -> Self::I;
    unsafe fn shr16(a: Self::I, n: i32) -> Self::I;
    unsafe fn shl32(a: Self::I, n: i32) -> Self::I;
    unsafe fn shr32(a: Self::I, n: i32) -> Self::I;
    /// Arithmetic shift right.
    unsafe fn sar32(a: Self::I, n: i32) -> Self::I;
    /// Unsigned bytes of `a` times signed bytes of `b`, adjacent pairs summed (saturating) into 16 bits.
    unsafe fn maddubs(a: Self::I, b: Self::I) -> Self::I;
    /// Signed 16-bit products, adjacent pairs summed into 32 bits.
    unsafe fn madd(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn to_f32(a: Self::I) -> Self::F;

    unsafe fn zero_f() -> Self::F;
    unsafe fn splat_f(v: f32) -> Self::F;
    unsafe fn add_f(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn mul_f(a: Self::F, b: Self::F) -> Self::F;
    /// `a * b + c`, fused.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
}

/// Sixteen rows: AVX-512 F and BW.
#[derive(Debug, Clone, Copy)]
pub struct L16;

/// Eight rows: AVX2, FMA and F16C.
#[derive(Debug, Clone, Copy)]
pub struct L8;

fn count(n: i32) -> __m128i {
    // SAFETY: SSE2 is part of x86_64.
    unsafe { _mm_cvtsi32_si128(n) }
}

impl Lanes for L16 {
    const ROWS: usize = 16;
    type I = __m512i;
    type F = __m512;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        _mm512_loadu_si512(p as *const __m512i)
    }
    #[inline(always)]
    unsafe fn halves(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn zero() -> __m512i {
        _mm512_setzero_si512()
    }
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m512i {
        _mm512_set1_epi8(v)
    }
    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m512i {
        _mm512_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        _mm512_and_si512(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        _mm512_or_si512(a, b)
    }
    #[inline(always)]
    unsafe fn add32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub16(a: __m512i, b: __m512i) -> __m512i {
        _mm512_sub_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn shl16(a: __m512i, n: i32) -> __m512i {
        _mm512_sll_epi16(a, count(n))
    }
    #[inline(always)]
    unsafe fn shr16(a: __m512i, n: i32) -> __m512i {
        _mm512_srl_epi16(a, count(n))
    }
    #[inline(always)]
    unsafe fn shl32(a: __m512i, n: i32) -> __m512i {
        _mm512_sll_epi32(a, count(n))
    }
    #[inline(always)]
    unsafe fn shr32(a: __m512i, n: i32) -> __m512i {
        _mm512_srl_epi32(a, count(n))
    }
    #[inline(always)]
    unsafe fn sar32(a: __m512i, n: i32) -> __m512i {
        _mm512_sra_epi32(a, count(n))
    }
    #[inline(always)]
    unsafe fn maddubs(a: __m512i, b: __m512i) -> __m512i {
        _mm512_maddubs_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn madd(a: __m512i, b: __m512i) -> __m512i {
        _mm512_madd_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn to_f32(a: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn zero_f() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn add_f(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul_f(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
}

impl Lanes for L8 {
    const ROWS: usize = 8;
    type I = __m256i;
    type F = __m256;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }
    #[inline(always)]
    unsafe fn halves(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn zero() -> __m256i {
        _mm256_setzero_si256()
    }
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m256i {
        _mm256_set1_epi8(v)
    }
    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m256i {
        _mm256_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
        _mm256_and_si256(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
        _mm256_or_si256(a, b)
    }
    #[inline(always)]
    unsafe fn add32(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub16(a: __m256i, b: __m256i) -> __m256i {
        _mm256_sub_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn shl16(a: __m256i, n: i32) -> __m256i {
        _mm256_sll_epi16(a, count(n))
    }
    #[inline(always)]
    unsafe fn shr16(a: __m256i, n: i32) -> __m256i {
        _mm256_srl_epi16(a, count(n))
    }
    #[inline(always)]
    unsafe fn shl32(a: __m256i, n: i32) -> __m256i {
        _mm256_sll_epi32(a, count(n))
    }
    #[inline(always)]
    unsafe fn shr32(a: __m256i, n: i32) -> __m256i {
        _mm256_srl_epi32(a, count(n))
    }
    #[inline(always)]
    unsafe fn sar32(a: __m256i, n: i32) -> __m256i {
        _mm256_sra_epi32(a, count(n))
    }
    #[inline(always)]
    unsafe fn maddubs(a: __m256i, b: __m256i) -> __m256i {
        _mm256_maddubs_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn madd(a: __m256i, b: __m256i) -> __m256i {
        _mm256_madd_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn to_f32(a: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn zero_f() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn add_f(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul_f(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
}

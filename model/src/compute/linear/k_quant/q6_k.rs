//! Q6_K: super-blocks of 256 values in sixteen sub-blocks of 16, each with a signed 8-bit scale
//! (`value = d * scale * (q - 32)`, `q` six bits); block bytes: 128 of low nibbles `ql`, 64 of high bit pairs
//! `qh`, sixteen scales, `d` (a half). In each half `n` of 128 values, `ql[64n + i]` holds values `128n + i`
//! (low nibble) and `128n + 64 + i` (high), `ql[64n + 32 + i]` values `+ 32` and `+ 96`, and `qh[32n + i]`'s four
//! bit pairs go to values `128n + i`, `+ 32`, `+ 64`, `+ 96`.
use super::q8_k::Q8KRow;
use super::{hsum8, BlockLayout, KFormat, Kernel, GROUP_ROWS};
use candle_core::quantized::GgmlDType;
use half::f16;

/// The format (its matrix is [`super::Q6KMatrix`]).
#[derive(Debug)]
pub struct Q6K;

const LAYOUT: BlockLayout = BlockLayout {
    bytes: 210,
    halves: &[208],
    words_at: 0,
    words: 52,
};
/// The group's words: 32 of `ql`, 16 of `qh`, then 4 of scales.
const QH_WORDS: usize = 32;
const SCALE_WORDS: usize = 48;

/// The 6-bit value of chunk `c` (32 values: `128n + 32c..`) from its `ql` and `qh` bytes.
fn six_bits(ql: u8, qh: u8, c: usize) -> u8 {
    let low = if c < 2 { ql & 0x0F } else { ql >> 4 };
    low | (((qh >> (2 * c)) & 3) << 4)
}

/// Where chunk `c` of half `n` finds the `ql` bytes of its values `4l..4l + 4`: word `16n + 8 (c % 2) + l`.
fn ql_word(n: usize, c: usize, l: usize) -> usize {
    16 * n + 8 * (c % 2) + l
}

impl KFormat for Q6K {
    const DTYPE: GgmlDType = GgmlDType::Q6K;
    const LAYOUT: BlockLayout = LAYOUT;

    fn dequantize(block: &[u8], out: &mut [f32]) {
        let d = f16::from_le_bytes([block[208], block[209]]).to_f32();
        let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
        for n in 0..2 {
            for i in 0..32 {
                for c in 0..4 {
                    let q = six_bits(ql[64 * n + 32 * (c % 2) + i], qh[32 * n + i], c) as i8 - 32;
                    let scale = sc[8 * n + i / 16 + 2 * c] as i8;
                    out[128 * n + 32 * c + i] = d * scale as f32 * q as f32;
                }
            }
        }
    }

    fn group_dots(kernel: Kernel, group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        let nb = group.len() / LAYOUT.group_bytes();
        assert!(
            group.len() == nb * LAYOUT.group_bytes()
                && out.len() >= xs.len()
                && xs
                    .iter()
                    .all(|x| x.d.len() == nb && x.qs.len() == nb && x.offsets.len() == nb)
        );
        match kernel {
            Kernel::Scalar => group_scalar(group, xs, out),
            // SAFETY: `available` lists it only on CPUs with AVX-512 BW; the lengths were checked above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::group_dots(group, xs, out) },
        }
    }
}

/// Candle's AVX2 `vec_dot_q6k_q8k` in scalar code: lane `l` of a row sums the scaled products of values
/// `4l..4l + 4` of each 32-value chunk exactly (weights `q - 32`), each super-block adds `d_x * d_w * lane` to it
/// (fused), and the lanes are summed as candle does.
fn group_scalar(group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    let gb = LAYOUT.group_bytes();
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let mut acc = [0f32; 8];
            for (b, sb) in group.chunks_exact(gb).enumerate() {
                let byte = |w: usize, t: usize| sb[LAYOUT.word_at(w) + 4 * k + t];
                let d = x.d[b] * f16::from_le_bytes([sb[2 * k], sb[2 * k + 1]]).to_f32();
                let mut sumi = [0i32; 8];
                for n in 0..2 {
                    for c in 0..4 {
                        for (l, s) in sumi.iter_mut().enumerate() {
                            let sub = 8 * n + 2 * c + l / 4;
                            let scale = byte(SCALE_WORDS + sub / 4, sub % 4) as i8 as i32;
                            for t in 0..4 {
                                let q = six_bits(
                                    byte(ql_word(n, c, l), t),
                                    byte(QH_WORDS + 8 * n + l, t),
                                    c,
                                );
                                let y = x.qs[b][128 * n + 32 * c + 4 * l + t] as i32;
                                *s += scale * (q as i32 - 32) * y;
                            }
                        }
                    }
                }
                for (a, s) in acc.iter_mut().zip(sumi) {
                    *a = d.mul_add(s as f32, *a);
                }
            }
            *o = hsum8(acc);
        }
    }
}

/// Sixteen rows per vector (one per 32-bit lane), one activation row at a time; a super-block's sixteen scales are
/// unpacked once into a buffer.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::super::prefetch_ahead;
    use super::{ql_word, Q8KRow, GROUP_ROWS, LAYOUT, QH_WORDS, SCALE_WORDS};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn group_dots(group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            row(group, x, o);
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn row(group: &[u8], x: &Q8KRow<'_>, out: &mut [f32; GROUP_ROWS]) {
        let gb = LAYOUT.group_bytes();
        let nibble = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); 8];
        let mut scales = [_mm512_setzero_si512(); 16];
        for b in 0..group.len() / gb {
            prefetch_ahead(group.as_ptr(), b, gb);
            let sb = group.as_ptr().add(b * gb);
            let load = |w: usize| _mm512_loadu_si512(sb.add(LAYOUT.word_at(w)) as *const __m512i);
            let d = _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256(sb as *const __m256i)),
                _mm512_set1_ps(x.d[b]),
            );
            // Each scale sign-extended, in both 16-bit halves of its lane.
            for (s, v) in scales.iter_mut().enumerate() {
                let w = load(SCALE_WORDS + s / 4);
                let one = _mm512_srai_epi32(
                    _mm512_sllv_epi32(w, _mm512_set1_epi32(24 - 8 * (s % 4) as i32)),
                    24,
                );
                *v = _mm512_or_si512(
                    _mm512_and_si512(one, _mm512_set1_epi32(0xFFFF)),
                    _mm512_slli_epi32(one, 16),
                );
            }
            let (y, offsets) = (x.qs[b].as_ptr(), &x.offsets[b]);
            let mut sumi = [_mm512_setzero_si512(); 8];
            for n in 0..2 {
                for (l, s) in sumi.iter_mut().enumerate() {
                    let qh = load(QH_WORDS + 8 * n + l);
                    let (qa, qb) = (load(ql_word(n, 0, l)), load(ql_word(n, 1, l)));
                    let six = [
                        _mm512_or_si512(
                            _mm512_and_si512(qa, nibble),
                            _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi8(0x03)), 4),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(qb, nibble),
                            _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi8(0x0C)), 2),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16(qa, 4), nibble),
                            _mm512_and_si512(qh, _mm512_set1_epi8(0x30)),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16(qb, 4), nibble),
                            _mm512_srli_epi16(
                                _mm512_and_si512(qh, _mm512_set1_epi8(0xC0u8 as i8)),
                                2,
                            ),
                        ),
                    ];
                    for (c, &q) in six.iter().enumerate() {
                        let v = 128 * n + 32 * c + 4 * l;
                        let yv = _mm512_set1_epi32((y.add(v) as *const i32).read_unaligned());
                        let p16 = _mm512_sub_epi16(
                            _mm512_maddubs_epi16(q, yv),
                            _mm512_set1_epi32(offsets[v / 4]),
                        );
                        let scale = scales[8 * n + 2 * c + l / 4];
                        *s = _mm512_add_epi32(*s, _mm512_madd_epi16(p16, scale));
                    }
                }
            }
            for (a, s) in acc.iter_mut().zip(sumi) {
                *a = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), *a);
            }
        }
        let h: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(acc[i + 4], acc[i]));
        let sums = _mm512_add_ps(_mm512_add_ps(h[0], h[2]), _mm512_add_ps(h[1], h[3]));
        _mm512_storeu_ps(out.as_mut_ptr(), sums);
    }
}

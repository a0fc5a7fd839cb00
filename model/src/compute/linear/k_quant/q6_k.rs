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
    order: &ORDER,
};

/// The group's words in the order the kernels read them: the four of scales (the block's last), then for each
/// lane `l` and half `n` the `ql` words of chunks 0 and 1 and the `qh` word (block words `16n + l`, `16n + 8 + l`,
/// `32 + 8n + l`).
const ORDER: [u8; 52] = {
    let mut order = [0u8; 52];
    let mut s = 0;
    while s < 4 {
        order[s] = 48 + s as u8;
        s += 1;
    }
    let mut l = 0;
    while l < 8 {
        let mut n = 0;
        while n < 2 {
            let at = lane_words(n, l);
            order[at] = (16 * n + l) as u8;
            order[at + 1] = (16 * n + 8 + l) as u8;
            order[at + 2] = (32 + 8 * n + l) as u8;
            n += 1;
        }
        l += 1;
    }
    order
};
const SCALE_WORDS: usize = 0;

/// The group's first word for lane `l` of half `n`: its `ql` words of chunks 0 and 1, then its `qh` word.
const fn lane_words(n: usize, l: usize) -> usize {
    4 + 6 * l + 3 * n
}

/// The 6-bit value of chunk `c` (32 values: `128n + 32c..`) from its `ql` and `qh` bytes.
fn six_bits(ql: u8, qh: u8, c: usize) -> u8 {
    let low = if c < 2 { ql & 0x0F } else { ql >> 4 };
    low | (((qh >> (2 * c)) & 3) << 4)
}

/// Where chunk `c` of half `n` finds the `ql` bytes of its values `4l..4l + 4`.
fn ql_word(n: usize, c: usize, l: usize) -> usize {
    lane_words(n, l) + c % 2
}

/// Where half `n` finds the `qh` bytes of its values `4l..4l + 4`.
fn qh_word(n: usize, l: usize) -> usize {
    lane_words(n, l) + 2
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
            // SAFETY: `available` lists each only on CPUs with its features; the lengths were checked above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { vector::group_dots_8(group, xs, out) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { vector::group_dots_16(group, xs, out) },
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
                                let q =
                                    six_bits(byte(ql_word(n, c, l), t), byte(qh_word(n, l), t), c);
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

/// One row per 32-bit lane (sixteen or eight rows a vector: a group in one pass or two), one activation row at a
/// time; a super-block's sixteen scales are unpacked once into a buffer.
#[cfg(target_arch = "x86_64")]
mod vector {
    use super::super::lanes::{Lanes, L16, L8};
    use super::{qh_word, ql_word, Q8KRow, GROUP_ROWS, LAYOUT, SCALE_WORDS};

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn group_dots_16(group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        group_dots::<L16>(group, xs, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dots_8(group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        group_dots::<L8>(group, xs, out)
    }

    #[inline(always)]
    unsafe fn group_dots<L: Lanes>(group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            row::<L>(group, x, o);
        }
    }

    /// The group's rows against one activation row; with eight rows a vector, the two halves of each super-block
    /// one after the other while its cache lines are in the first-level cache (as Q4_K's).
    #[inline(always)]
    unsafe fn row<L: Lanes>(group: &[u8], x: &Q8KRow<'_>, out: &mut [f32; GROUP_ROWS]) {
        let gb = LAYOUT.group_bytes();
        let nibble = L::splat8(0x0F);
        let parts = GROUP_ROWS / L::ROWS;
        let mut acc = [[L::zero_f(); 8]; 2];
        let mut scales = [L::zero(); 16];
        for b in 0..group.len() / gb {
            let sb = group.as_ptr().add(b * gb);
            for (part, acc) in acc.iter_mut().enumerate().take(parts) {
                let load = |w: usize| L::load(sb.add(LAYOUT.word_at(w) + part * 4 * L::ROWS));
                let d = L::mul_f(L::halves(sb.add(part * 2 * L::ROWS)), L::splat_f(x.d[b]));
                // Each scale sign-extended, in both 16-bit halves of its lane.
                for (s, v) in scales.iter_mut().enumerate() {
                    let w = load(SCALE_WORDS + s / 4);
                    let one = L::sar32(L::shl32(w, 24 - 8 * (s % 4) as i32), 24);
                    *v = L::or(L::and(one, L::splat32(0xFFFF)), L::shl32(one, 16));
                }
                let (y, offsets) = (x.qs[b].as_ptr(), &x.offsets[b]);
                // Lane `l`'s integer sum in a register of its own (a sum of eight lanes in an array ended up on
                // the stack, half the speed); integers add exactly in any order.
                for (l, a) in acc.iter_mut().enumerate() {
                    let mut sum = L::zero();
                    for n in 0..2 {
                        let qh = load(qh_word(n, l));
                        let (qa, qb) = (load(ql_word(n, 0, l)), load(ql_word(n, 1, l)));
                        let six = [
                            L::or(L::and(qa, nibble), L::shl16(L::and(qh, L::splat8(0x03)), 4)),
                            L::or(L::and(qb, nibble), L::shl16(L::and(qh, L::splat8(0x0C)), 2)),
                            L::or(L::and(L::shr16(qa, 4), nibble), L::and(qh, L::splat8(0x30))),
                            L::or(
                                L::and(L::shr16(qb, 4), nibble),
                                L::shr16(L::and(qh, L::splat8(0xC0u8 as i8)), 2),
                            ),
                        ];
                        for (c, &q) in six.iter().enumerate() {
                            let v = 128 * n + 32 * c + 4 * l;
                            let yv = L::splat32((y.add(v) as *const i32).read_unaligned());
                            let p16 = L::sub16(L::maddubs(q, yv), L::splat32(offsets[v / 4]));
                            let scale = scales[8 * n + 2 * c + l / 4];
                            sum = L::add32(sum, L::madd(p16, scale));
                        }
                    }
                    *a = L::fmadd(d, L::to_f32(sum), *a);
                }
            }
        }
        for (part, acc) in acc.iter().enumerate().take(parts) {
            let h: [L::F; 4] = std::array::from_fn(|i| L::add_f(acc[i + 4], acc[i]));
            let sums = L::add_f(L::add_f(h[0], h[2]), L::add_f(h[1], h[3]));
            L::store(out.as_mut_ptr().add(part * L::ROWS), sums);
        }
    }
}

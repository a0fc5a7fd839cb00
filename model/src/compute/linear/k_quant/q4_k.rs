//! Q4_K and Q5_K: super-blocks of 256 values in eight sub-blocks of 32, each with a 6-bit scale and a 6-bit
//! minimum (`value = d * scale * q - dmin * min`); block bytes `d`, `dmin` (halves), twelve bytes of packed scales
//! and minimums, for Q5_K 32 bytes `qh` of fifth bits, then 128 of nibbles (byte `32j + i`: value `64j + i` in its
//! low nibble, `64j + 32 + i` in its high one; their fifth bits are bits `2j` and `2j + 1` of `qh[i]`).
use super::q8_k::{Q8KRow, QK_K};
use super::{hsum8, BlockLayout, KFormat, Kernel, GROUP_ROWS};
use candle_core::quantized::GgmlDType;
use half::f16;

/// Q4_K (its matrix is [`super::Q4KMatrix`]).
#[derive(Debug)]
pub struct Q4K;

/// Q5_K (its matrix is [`super::Q5KMatrix`]).
#[derive(Debug)]
pub struct Q5K;

/// The layout with (`FIFTH`) or without the fifth bits: words of packed scales and minimums, of `qh`, of nibbles.
const fn layout(fifth: bool) -> BlockLayout {
    let qh_words = if fifth { 8 } else { 0 };
    BlockLayout {
        bytes: 16 + 4 * qh_words + 128,
        halves: &[0, 2],
        words_at: 4,
        words: SCALE_WORDS + qh_words + 32,
        order: &[],
    }
}
const SCALE_WORDS: usize = 3;
/// The group's first word of nibbles.
const fn nibble_words(fifth: bool) -> usize {
    SCALE_WORDS + if fifth { 8 } else { 0 }
}

const KMASK1: u32 = 0x3f3f3f3f;
const KMASK2: u32 = 0x0f0f0f0f;
const KMASK3: u32 = 0x03030303;

/// The eight scales and eight minimums from the three packed words, four bytes a word (candle's `utmp`).
fn scales_and_mins(u: [u32; 3]) -> ([u8; 8], [u8; 8]) {
    let sc = [
        u[0] & KMASK1,
        (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4),
    ];
    let mn = [
        u[1] & KMASK1,
        ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4),
    ];
    let bytes = |w: [u32; 2]| std::array::from_fn(|i| (w[i / 4] >> (8 * (i % 4))) as u8);
    (bytes(sc), bytes(mn))
}

fn word(block: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
}

/// Value `v`'s bits from its nibble byte `q` (`high`: the high nibble) and, with the fifth bits, its `qh` byte.
fn value(q: u8, high: bool, qh: u8, j: usize) -> i32 {
    let nibble = if high { q >> 4 } else { q & 0x0F };
    (nibble | ((qh >> (2 * j + high as usize)) & 1) << 4) as i32
}

fn dequantize<const FIFTH: bool>(block: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    let min = f16::from_le_bytes([block[2], block[3]]).to_f32();
    let (sc, mn) = scales_and_mins([word(block, 4), word(block, 8), word(block, 12)]);
    let qs = &block[layout(FIFTH).bytes - 128..];
    for j in 0..QK_K / 64 {
        let (d1, m1) = (d * sc[2 * j] as f32, min * mn[2 * j] as f32);
        let (d2, m2) = (d * sc[2 * j + 1] as f32, min * mn[2 * j + 1] as f32);
        for l in 0..32 {
            let (q, qh) = (qs[32 * j + l], if FIFTH { block[16 + l] } else { 0 });
            out[64 * j + l] = d1 * value(q, false, qh, j) as f32 - m1;
            out[64 * j + 32 + l] = d2 * value(q, true, qh, j) as f32 - m2;
        }
    }
}

fn group_dots<const FIFTH: bool>(
    kernel: Kernel,
    group: &[u8],
    xs: &[Q8KRow<'_>],
    out: &mut [[f32; GROUP_ROWS]],
) {
    let gb = layout(FIFTH).group_bytes();
    let nb = group.len() / gb;
    assert!(
        group.len() == nb * gb
            && out.len() >= xs.len()
            && xs
                .iter()
                .all(|x| x.d.len() == nb && x.qs.len() == nb && x.sub_sums.len() == nb)
    );
    match kernel {
        Kernel::Scalar => group_scalar::<FIFTH>(group, xs, out),
        // SAFETY: `available` lists each only on CPUs with its features; the lengths were checked above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { vector::group_dots_8::<FIFTH>(group, xs, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { vector::group_dots_16::<FIFTH>(group, xs, out) },
    }
}

impl KFormat for Q4K {
    const DTYPE: GgmlDType = GgmlDType::Q4K;
    const LAYOUT: BlockLayout = layout(false);

    fn dequantize(block: &[u8], out: &mut [f32]) {
        dequantize::<false>(block, out)
    }

    fn group_dots(kernel: Kernel, group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        group_dots::<false>(kernel, group, xs, out)
    }
}

impl KFormat for Q5K {
    const DTYPE: GgmlDType = GgmlDType::Q5K;
    const LAYOUT: BlockLayout = layout(true);

    fn dequantize(block: &[u8], out: &mut [f32]) {
        dequantize::<true>(block, out)
    }

    fn group_dots(kernel: Kernel, group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        group_dots::<true>(kernel, group, xs, out)
    }
}

/// Candle's AVX2 `vec_dot_q4k_q8k` / `vec_dot_q5k_q8k` in scalar code: lane `l` of a row sums the scaled products
/// of values `4l..4l + 4` of each 32-value sub-block exactly, each super-block adds `d_x * d_w * lane` to it
/// (fused); the minimums add `-d_x * dmin_w * sum`, for Q4_K in four lanes (two sub-blocks each, fused), for Q5_K
/// in one sum (not fused); the lanes are summed as candle does.
fn group_scalar<const FIFTH: bool>(group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    let layout = layout(FIFTH);
    let gb = layout.group_bytes();
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let (mut acc, mut acc_m, mut sum_m) = ([0f32; 8], [0f32; 4], 0f32);
            for (b, sb) in group.chunks_exact(gb).enumerate() {
                let half = |i: usize| {
                    let at = i * 2 * GROUP_ROWS + 2 * k;
                    f16::from_le_bytes([sb[at], sb[at + 1]]).to_f32()
                };
                let d = x.d[b] * half(0);
                let dmin = -x.d[b] * half(1);
                let packed = std::array::from_fn(|w| word(sb, layout.word_at(w) + 4 * k));
                let (sc, mn) = scales_and_mins(packed);
                // Minimums `2i` and `2i + 1` times the activations' sums of those sub-blocks.
                let prods: [i32; 4] = std::array::from_fn(|i| {
                    let sums = x.sub_sums[b][i];
                    mn[2 * i] as i32 * (sums as i16) as i32 + mn[2 * i + 1] as i32 * (sums >> 16)
                });
                if FIFTH {
                    sum_m += dmin * prods.iter().sum::<i32>() as f32;
                } else {
                    for (a, p) in acc_m.iter_mut().zip(prods) {
                        *a = dmin.mul_add(p as f32, *a);
                    }
                }
                let mut sumi = [0i32; 8];
                for j in 0..QK_K / 64 {
                    for (l, s) in sumi.iter_mut().enumerate() {
                        let at = layout.word_at(nibble_words(FIFTH) + 8 * j + l) + 4 * k;
                        let qh_at = layout.word_at(SCALE_WORDS + l) + 4 * k;
                        for (t, &q) in sb[at..at + 4].iter().enumerate() {
                            let qh = if FIFTH { sb[qh_at + t] } else { 0 };
                            let v = 64 * j + 4 * l + t;
                            *s += sc[2 * j] as i32 * value(q, false, qh, j) * x.qs[b][v] as i32
                                + sc[2 * j + 1] as i32
                                    * value(q, true, qh, j)
                                    * x.qs[b][v + 32] as i32;
                        }
                    }
                }
                for (a, s) in acc.iter_mut().zip(sumi) {
                    *a = d.mul_add(s as f32, *a);
                }
            }
            *o = if FIFTH {
                hsum8(acc) + sum_m
            } else {
                hsum8(acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
            };
        }
    }
}

/// One row per 32-bit lane (sixteen or eight rows a vector: a group in one pass or two), one activation row at a
/// time: its eight lanes' integer sums and float sums and the minimums' four take twenty registers.
#[cfg(target_arch = "x86_64")]
mod vector {
    use super::super::lanes::{Lanes, L16, L8};
    use super::{
        layout, nibble_words, Q8KRow, GROUP_ROWS, KMASK1, KMASK2, KMASK3, QK_K, SCALE_WORDS,
    };

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn group_dots_16<const FIFTH: bool>(
        group: &[u8],
        xs: &[Q8KRow<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        group_dots::<L16, FIFTH>(group, xs, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dots_8<const FIFTH: bool>(
        group: &[u8],
        xs: &[Q8KRow<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        group_dots::<L8, FIFTH>(group, xs, out)
    }

    #[inline(always)]
    unsafe fn group_dots<L: Lanes, const FIFTH: bool>(
        group: &[u8],
        xs: &[Q8KRow<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            row::<L, FIFTH>(group, x, o);
        }
    }

    /// Each lane's byte `s % 4` of `w` (unsigned), in both 16-bit halves of the lane: a scale as `madd` takes it.
    #[inline(always)]
    unsafe fn scale_pairs<L: Lanes>(w: L::I, s: usize) -> L::I {
        let v = L::and(L::shr32(w, 8 * (s % 4) as i32), L::splat32(0xFF));
        L::or(v, L::shl32(v, 16))
    }

    /// The group's rows against one activation row. With eight rows a vector, the two halves of each super-block
    /// are taken one after the other, while its cache lines (each holding both halves' words) are in the
    /// first-level cache; the sums of both stay live.
    #[inline(always)]
    unsafe fn row<L: Lanes, const FIFTH: bool>(
        group: &[u8],
        x: &Q8KRow<'_>,
        out: &mut [f32; GROUP_ROWS],
    ) {
        let layout = layout(FIFTH);
        let gb = layout.group_bytes();
        let one = L::splat8(1);
        let nibble = L::splat8(0x0F);
        let (k1, k2, k3) = (
            L::splat32(KMASK1 as i32),
            L::splat32(KMASK2 as i32),
            L::splat32(KMASK3 as i32),
        );
        let parts = GROUP_ROWS / L::ROWS;
        let mut sum_m = [L::zero_f(); 2];
        let mut acc = [[L::zero_f(); 8]; 2];
        let mut acc_m = [[L::zero_f(); 4]; 2];
        for b in 0..group.len() / gb {
            let sb = group.as_ptr().add(b * gb);
            for part in 0..parts {
                let (acc, acc_m, sum_m) = (&mut acc[part], &mut acc_m[part], &mut sum_m[part]);
                let load = |w: usize| L::load(sb.add(layout.word_at(w) + part * 4 * L::ROWS));
                let half = |i: usize| L::halves(sb.add(i * 2 * GROUP_ROWS + part * 2 * L::ROWS));
                let d = L::mul_f(half(0), L::splat_f(x.d[b]));
                let dmin = L::mul_f(half(1), L::splat_f(-x.d[b]));
                let (u0, u1, u2) = (load(0), load(1), load(2));
                let sc = [
                    L::and(u0, k1),
                    L::or(L::and(u2, k2), L::shl32(L::and(L::shr32(u0, 6), k3), 4)),
                ];
                let mn = [
                    L::and(u1, k1),
                    L::or(
                        L::and(L::shr32(u2, 4), k2),
                        L::shl32(L::and(L::shr32(u1, 6), k3), 4),
                    ),
                ];
                // Minimums `2i` and `2i + 1` as the two halves of each lane, against the activations' sums of
                // those sub-blocks.
                let (low_byte, third_byte) = (L::splat32(0xFF), L::splat32(0xFF_0000));
                let mut prods = [L::zero(); 4];
                for (i, prod) in prods.iter_mut().enumerate() {
                    let w = mn[i / 2];
                    let pair = if i % 2 == 0 {
                        L::or(
                            L::and(w, low_byte),
                            L::shl32(L::and(w, L::splat32(0xFF00)), 8),
                        )
                    } else {
                        L::or(
                            L::and(L::shr32(w, 16), low_byte),
                            L::and(L::shr32(w, 8), third_byte),
                        )
                    };
                    *prod = L::madd(pair, L::splat32(x.sub_sums[b][i]));
                }
                if FIFTH {
                    let total =
                        L::add32(L::add32(prods[0], prods[1]), L::add32(prods[2], prods[3]));
                    *sum_m = L::add_f(*sum_m, L::mul_f(dmin, L::to_f32(total)));
                } else {
                    for (a, p) in acc_m.iter_mut().zip(prods) {
                        *a = L::fmadd(dmin, L::to_f32(p), *a);
                    }
                }
                let y = x.qs[b].as_ptr();
                let mut sumi = [L::zero(); 8];
                for j in 0..QK_K / 64 {
                    let (s_lo, s_hi) = (
                        scale_pairs::<L>(sc[j / 2], 2 * j),
                        scale_pairs::<L>(sc[j / 2], 2 * j + 1),
                    );
                    for (l, s) in sumi.iter_mut().enumerate() {
                        let bits = load(nibble_words(FIFTH) + 8 * j + l);
                        let mut lo = L::and(bits, nibble);
                        let mut hi = L::and(L::shr16(bits, 4), nibble);
                        if FIFTH {
                            // Bits `2j` and `2j + 1` of each `qh` byte, as each value's bit 4.
                            let qh = load(SCALE_WORDS + l);
                            let fifth = |shift: i32| L::shl16(L::and(L::shr16(qh, shift), one), 4);
                            lo = L::or(lo, fifth(2 * j as i32));
                            hi = L::or(hi, fifth(2 * j as i32 + 1));
                        }
                        let y_lo =
                            L::splat32((y.add(64 * j + 4 * l) as *const i32).read_unaligned());
                        let y_hi =
                            L::splat32((y.add(64 * j + 32 + 4 * l) as *const i32).read_unaligned());
                        *s = L::add32(*s, L::madd(L::maddubs(lo, y_lo), s_lo));
                        *s = L::add32(*s, L::madd(L::maddubs(hi, y_hi), s_hi));
                    }
                }
                for (a, s) in acc.iter_mut().zip(sumi) {
                    *a = L::fmadd(d, L::to_f32(s), *a);
                }
            }
        }
        for part in 0..parts {
            let (acc, acc_m) = (&acc[part], &acc_m[part]);
            let h: [L::F; 4] = std::array::from_fn(|i| L::add_f(acc[i + 4], acc[i]));
            let sums = L::add_f(L::add_f(h[0], h[2]), L::add_f(h[1], h[3]));
            let mins = if FIFTH {
                sum_m[part]
            } else {
                L::add_f(L::add_f(acc_m[0], acc_m[2]), L::add_f(acc_m[1], acc_m[3]))
            };
            L::store(out.as_mut_ptr().add(part * L::ROWS), L::add_f(sums, mins));
        }
    }
}

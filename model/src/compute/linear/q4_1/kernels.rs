//! The Q4_1 x Q8_1 products of one group of interleaved weight rows ([`super::GROUP_ROWS`]) with a tile of
//! activation rows: a scalar reference and x86 kernels chosen at run time.
//!
//! Candle computes this product with its generic scalar loop, one weight row at a time; it is most of a Q4_1 model's
//! decode time. Here each vector lane belongs to a different weight row: a lane's four weight bytes meet the same
//! four activation bytes, broadcast to every lane, so one `dpbusd` (or `maddubs` + `madd`) advances sixteen (eight)
//! rows' integer sums by four products each with no horizontal reduction, and the block's float terms are formed for
//! all of them at once. The unpacked weights stay in registers for every activation row of the tile.
//!
//! Every kernel gives the reference's result bit for bit: integer sums are exact, and each row's float terms
//! `sumi * d_w * d_y + m_w * s_y` are formed and added in the reference's order (one lane, block after block, no
//! fused multiply-add).
//!
//! Q5_1 ([`super::super::q5_1`]) is the same product with a fifth bit on each weight: a group that has them
//! (`high`) gets them added as its blocks are unpacked, by a second instance of each kernel (the const `FIVE`), so
//! that Q4_1's does no more work than before.
use super::super::{fifth_bits, q8_1::Q8Row};
use super::{Q4_1Group, BLOCK_MASKS, BLOCK_QS, GROUP_ROWS, PART_BYTES};

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
    /// AMX tiles for sixteen activation rows at a time, the 512-bit kernel for the rest.
    #[cfg(target_arch = "x86_64")]
    Amx,
}

impl Kernel {
    /// Every kernel this CPU can run, slowest first (tests check each against the reference).
    pub fn available() -> Vec<Self> {
        let mut all = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = super::super::cpu_features();
            if cpu.avx2 {
                all.push(Kernel::Avx2);
            }
            if cpu.avx_vnni {
                all.push(Kernel::AvxVnni);
            }
            if cpu.avx512_vnni {
                all.push(Kernel::Avx512Vnni);
            }
            if cpu.amx {
                all.push(Kernel::Amx);
            }
        }
        all
    }

    /// The fastest of [`Self::available`].
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = super::super::cpu_features();
            if cpu.amx {
                return Kernel::Amx;
            }
            if cpu.avx512_vnni {
                return Kernel::Avx512Vnni;
            }
            if cpu.avx_vnni {
                return Kernel::AvxVnni;
            }
            if cpu.avx2 {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// Whether this kernel reads the activations' [`SplatScales`](super::super::q8_1::SplatScales) (the 256-bit
    /// ones), so that quantizing writes them only for it.
    pub fn reads_splat_scales(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(self, Kernel::Avx2 | Kernel::AvxVnni) {
            return true;
        }
        false
    }

    /// `out[r][k] = dot(row k of w, ys[r])` for every activation row, each as long as `w`'s rows (with its
    /// `splat` scales too for a kernel that [reads them](Self::reads_splat_scales)).
    pub fn group_dots(self, w: Q4_1Group<'_>, ys: &[Q8Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        let nb = w.blocks();
        let splat = self.reads_splat_scales();
        assert!(
            ys.iter().all(|y| y.d.len() == nb
                && y.s.len() == nb
                && y.qs.len() == nb
                && (!splat || y.splat.len() == nb))
                && out.len() >= ys.len()
                && (w.high.is_empty() || w.high.len() == nb * BLOCK_MASKS)
        );
        match self {
            Kernel::Scalar => group_scalar(w, ys, out),
            // SAFETY (all four): `available` lists a kernel only after checking the CPU has its features;
            // lengths were checked above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::group_dots(w, ys, out) },
            #[cfg(target_arch = "x86_64")]
            Kernel::AvxVnni => unsafe { avx_vnni::group_dots(w, ys, out) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => unsafe { avx512_vnni::group_dots(w, ys, out) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => unsafe { amx::group_dots(w, ys, out) },
        }
    }
}

/// The reference, in ggml's generic `vec_dot_q4_1_q8_1` (and `vec_dot_q5_1_q8_1`) order of operations (candle's
/// too), on the interleaved layout: byte `t` of lane `k` in part `p` of a block is byte `4p + t` of row `k`'s ggml
/// nibbles, whose low nibble is value `4p + t` and high nibble value `4p + t + 16`.
fn group_scalar(w: Q4_1Group<'_>, ys: &[Q8Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    for (y, o) in ys.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let mut sum = 0f32;
            for b in 0..w.blocks() {
                let fifth = |part: usize, t: usize| match w.high.is_empty() {
                    true => 0,
                    false => {
                        let masks = &w.high[b * BLOCK_MASKS..(b + 1) * BLOCK_MASKS];
                        fifth_bits::scalar(masks, part, (k, t)) as i32
                    }
                };
                let mut sumi = 0i32;
                for p in 0..4 {
                    for t in 0..4 {
                        let q = w.qs[b * BLOCK_QS + p * PART_BYTES + 4 * k + t];
                        let j = 4 * p + t;
                        sumi += ((q & 0x0F) as i32 | fifth(p, t)) * y.qs[b][j] as i32
                            + ((q >> 4) as i32 | fifth(p + 4, t)) * y.qs[b][j + 16] as i32;
                    }
                }
                let (d, m) = (w.d[b * GROUP_ROWS + k], w.m[b * GROUP_ROWS + k]);
                sum += sumi as f32 * d.to_f32() * y.d[b] + m.to_f32() * y.s[b];
            }
            *o = sum;
        }
    }
}

/// Eight lanes (weight rows) per vector: the group in two halves. The kernels differ only in how a block's 32 byte
/// products per lane are summed into its 32-bit lane (`$five`: whether the weights have their fifth bits, up to 31).
#[cfg(target_arch = "x86_64")]
macro_rules! x86_256_kernel {
    ($module:ident, $features:literal, |$q:ident, $y:ident, $five:ident| $sum:block) => {
        mod $module {
            use super::super::super::fifth_bits::spread_avx2;
            use super::super::super::q8_1::{Q8Row, SplatScales};
            use super::super::{Q4_1Group, BLOCK_MASKS, BLOCK_QS, GROUP_ROWS, PART_BYTES};
            use crate::compute::linear::prefetch_ahead;
            use std::arch::x86_64::*;

            /// Lanes per vector.
            const LANES: usize = 8;

            #[target_feature(enable = $features)]
            pub unsafe fn group_dots(
                w: Q4_1Group<'_>,
                ys: &[Q8Row<'_>],
                out: &mut [[f32; GROUP_ROWS]],
            ) {
                // Sixteen vector registers hold eight unpacked weight parts, two scale vectors and a few rows'
                // accumulators; eight rows a tile spill some of those to the first-level cache, yet measured
                // 1.05-1.1x faster than four (Zen 3, 16 and 64 rows): the weights are unpacked half as often.
                if w.high.is_empty() {
                    by_tiles!(tile[false], 8, w, ys, out)
                } else {
                    by_tiles!(tile[true], 8, w, ys, out)
                }
            }

            /// In each 32-bit lane, the sum of a block's 32 products of unsigned weights (`$q[p]`: values `4p..4p +
            /// 4` of the block, `$q[p + 4]`: values `4p + 16..4p + 20`; nibbles, or up to 31 when `$five`) and
            /// signed activation bytes (`$y`: the block's 32 bytes as eight 32-bit words).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn block_sum<const $five: bool>($q: &[__m256i; 8], $y: *const i32) -> __m256i {
                $sum
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile<const N: usize, const FIVE: bool>(
                w: Q4_1Group<'_>,
                ys: &[Q8Row<'_>],
                out: &mut [[f32; GROUP_ROWS]],
            ) {
                let mask = _mm256_set1_epi8(0x0F);
                // Each row's bytes and scales through plain pointers (`Kernel::group_dots` checked their lengths):
                // indexing the rows' slices inside the loop reloaded every slice and checked every index, block
                // after block.
                let qs: [*const i32; N] = std::array::from_fn(|r| ys[r].qs.as_ptr() as *const i32);
                let scales: [*const SplatScales; N] = std::array::from_fn(|r| ys[r].splat.as_ptr());
                for half in 0..GROUP_ROWS / LANES {
                    let mut acc = [_mm256_setzero_ps(); N];
                    for b in 0..w.blocks() {
                        let base = w.qs.as_ptr().add(b * BLOCK_QS + half * 4 * LANES);
                        // As in the 512-bit kernel: the first half's pass brings each block from memory.
                        if N > 1 && half == 0 {
                            prefetch_ahead(w.qs.as_ptr(), b, BLOCK_QS);
                        }
                        let mut q = [_mm256_setzero_si256(); 8];
                        for p in 0..4 {
                            let packed =
                                _mm256_loadu_si256(base.add(p * PART_BYTES) as *const __m256i);
                            q[p] = _mm256_and_si256(packed, mask);
                            q[p + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
                        }
                        if FIVE {
                            // This half's lanes are bits 32 * half.. of each part's mask.
                            let high = w.high.as_ptr().add(b * BLOCK_MASKS);
                            for (p, q) in q.iter_mut().enumerate() {
                                let bits = (*high.add(p) >> (32 * half)) as u32;
                                *q = _mm256_or_si256(*q, spread_avx2(bits));
                            }
                        }
                        let at = b * GROUP_ROWS + half * LANES;
                        let wd = _mm256_cvtph_ps(_mm_loadu_si128(
                            w.d.as_ptr().add(at) as *const __m128i
                        ));
                        let wm = _mm256_cvtph_ps(_mm_loadu_si128(
                            w.m.as_ptr().add(at) as *const __m128i
                        ));
                        each_row!(N, |r| {
                            let sumi = _mm256_cvtepi32_ps(block_sum::<FIVE>(&q, qs[r].add(b * 8)));
                            let scale = &*scales[r].add(b);
                            let yd = _mm256_load_ps(scale.d.as_ptr());
                            let ysum = _mm256_load_ps(scale.s.as_ptr());
                            let term = _mm256_add_ps(
                                _mm256_mul_ps(_mm256_mul_ps(sumi, wd), yd),
                                _mm256_mul_ps(wm, ysum),
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
    };
}

// `maddubs` sums pairs of products into 16-bit lanes. Nibbles are at most 15, so a pair is at most 2 * 15 * 128 in
// size and the eight parts' pairs add up to at most 30,720: the block's sums stay exact in 16 bits, and one `madd`
// widens them to 32 at the end. Widening each part instead (a `madd` and an add per part) was 16 of the multiply
// pipes' operations per block and row, against 9 now; those pipes bound this kernel on CPUs without VNNI. Five-bit
// weights (Q5_1) make a pair up to 2 * 31 * 128 = 7,936, so four parts' pairs fit (31,744) and eight do not: the
// two halves are widened apart.
#[cfg(target_arch = "x86_64")]
x86_256_kernel!(avx2, "avx2,fma,f16c", |q, y, FIVE| {
    let mut parts = [_mm256_setzero_si256(); 8];
    for (p, part) in parts.iter_mut().enumerate() {
        *part = _mm256_maddubs_epi16(q[p], _mm256_set1_epi32(y.add(p).read_unaligned()));
    }
    // A tree of adds, so they do not wait on one another.
    let lo = _mm256_add_epi16(
        _mm256_add_epi16(parts[0], parts[1]),
        _mm256_add_epi16(parts[2], parts[3]),
    );
    let hi = _mm256_add_epi16(
        _mm256_add_epi16(parts[4], parts[5]),
        _mm256_add_epi16(parts[6], parts[7]),
    );
    let ones = _mm256_set1_epi16(1);
    if FIVE {
        _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
    } else {
        _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones)
    }
});
// VNNI sums four byte products straight into the 32-bit lane: one instruction per part, in two chains of four.
#[cfg(target_arch = "x86_64")]
x86_256_kernel!(avx_vnni, "avx2,fma,f16c,avxvnni", |q, y, _FIVE| {
    let mut lo = _mm256_setzero_si256();
    let mut hi = _mm256_setzero_si256();
    for p in 0..4 {
        lo = _mm256_dpbusd_avx_epi32(lo, q[p], _mm256_set1_epi32(y.add(p).read_unaligned()));
        hi = _mm256_dpbusd_avx_epi32(
            hi,
            q[p + 4],
            _mm256_set1_epi32(y.add(p + 4).read_unaligned()),
        );
    }
    _mm256_add_epi32(lo, hi)
});

/// Sixteen lanes per vector: the whole group at once.
#[cfg(target_arch = "x86_64")]
mod avx512_vnni {
    use super::super::super::q8_1::Q8Row;
    use super::super::{Q4_1Group, BLOCK_MASKS, BLOCK_QS, GROUP_ROWS, PART_BYTES};
    use crate::compute::linear::{block_dot_512, prefetch_ahead};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q4_1Group<'_>, ys: &[Q8Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        if w.high.is_empty() {
            by_wide_tiles!(tile[false], w, ys, out)
        } else {
            by_wide_tiles!(tile[true], w, ys, out)
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const N: usize, const FIVE: bool>(
        w: Q4_1Group<'_>,
        ys: &[Q8Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let mask = _mm512_set1_epi8(0x0F);
        // Each row's bytes and scales through plain pointers (`Kernel::group_dots` checked their lengths): with
        // sixteen rows, indexing their slices inside the loop made the wider tile slower than two of eight.
        let qs: [*const i32; N] = std::array::from_fn(|r| ys[r].qs.as_ptr() as *const i32);
        let ds: [*const f32; N] = std::array::from_fn(|r| ys[r].d.as_ptr());
        let ss: [*const f32; N] = std::array::from_fn(|r| ys[r].s.as_ptr());
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..w.blocks() {
            let base = w.qs.as_ptr().add(b * BLOCK_QS);
            // With several rows a block computes long enough for the next weights, which come from memory, to
            // arrive late: fetch a few blocks ahead. A lone row streams fast enough for the hardware prefetcher.
            if N > 1 {
                prefetch_ahead(w.qs.as_ptr(), b, BLOCK_QS);
            }
            let q = unpack::<FIVE>(w, b, base, mask);
            let at = b * GROUP_ROWS;
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(at) as *const __m256i));
            let wm = _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(at) as *const __m256i));
            each_row!(N, |r| {
                let sumi = block_dot_512(&q, qs[r].add(b * 8));
                acc[r] = block_terms(acc[r], sumi, (wd, wm), (*ds[r].add(b), *ss[r].add(b)));
            });
        }
        for r in 0..N {
            _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
        }
    }

    /// Block `b`'s eight parts (`base`: its nibble bytes), its fifth bits added when `FIVE`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn unpack<const FIVE: bool>(
        w: Q4_1Group<'_>,
        b: usize,
        base: *const u8,
        mask: __m512i,
    ) -> [__m512i; 8] {
        let mut q = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            let packed = _mm512_loadu_si512(base.add(p * PART_BYTES) as *const __m512i);
            q[p] = _mm512_and_si512(packed, mask);
            q[p + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
        }
        if FIVE {
            let high = w.high.as_ptr().add(b * BLOCK_MASKS);
            let fifth = _mm512_set1_epi8(0x10);
            for (p, q) in q.iter_mut().enumerate() {
                *q = _mm512_mask_add_epi8(*q, *high.add(p), *q, fifth);
            }
        }
        q
    }

    /// `acc + ((sumi * d_w) * d_y + m_w * s_y)` for one activation block (its scale and sum `(d_y, s_y)`) and
    /// sixteen weight rows (their integer sums `sumi`, scales `d_w`, minimums `m_w`): the reference's float terms,
    /// in its order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn block_terms(
        acc: __m512,
        sumi: __m512i,
        (wd, wm): (__m512, __m512),
        (yd, ysum): (f32, f32),
    ) -> __m512 {
        let sumi = _mm512_cvtepi32_ps(sumi);
        let yd = _mm512_set1_ps(yd);
        let ysum = _mm512_set1_ps(ysum);
        let term = _mm512_add_ps(
            _mm512_mul_ps(_mm512_mul_ps(sumi, wd), yd),
            _mm512_mul_ps(wm, ysum),
        );
        _mm512_add_ps(acc, term)
    }
}

/// Sixteen activation rows at a time: a tile multiply gives every row's integer sums for a block at once, and the
/// vector pipes form only the float terms. The weights are unpacked once per block into the tile's layout (which
/// the interleaved parts already are, nibble by nibble) a block before its tile product, and that product is
/// started a block before the float terms that read its sums, so the two units overlap and neither waits for
/// memory just written.
#[cfg(target_arch = "x86_64")]
mod amx {
    use super::super::super::amx::{
        by_tiles, configure_thread, signed_by_unsigned, B_BYTES, TILE_ROWS,
    };
    use super::super::super::q8_1::{Q8Row, QK8_1};
    use super::super::{Q4_1Group, BLOCK_QS, GROUP_ROWS};
    use crate::compute::linear::prefetch_ahead;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    use std::ptr::addr_of_mut;

    /// A tile's integer sums, row `r` (activation row) holding the group's sixteen weight rows.
    type Sums = [i32; TILE_ROWS * GROUP_ROWS];

    /// Two blocks' unpacked weights and sums, by block parity: one block's being read while the next one's are
    /// written.
    #[repr(C, align(64))]
    struct Scratch {
        weights: [[u8; B_BYTES]; 2],
        sums: [Sums; 2],
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q4_1Group<'_>, ys: &[Q8Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
        // SAFETY (both): the caller's CPU has AMX and AVX-512 VNNI; lengths were checked by `Kernel::group_dots`.
        by_tiles(
            ys,
            out,
            |y| y.qs.as_ptr() as usize,
            |rows, stride, out| unsafe {
                match w.high.is_empty() {
                    true => tile::<false>(w, rows, stride, out),
                    false => tile::<true>(w, rows, stride, out),
                }
            },
            |rows, out| unsafe { super::avx512_vnni::group_dots(w, rows, out) },
        );
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const FIVE: bool>(
        w: Q4_1Group<'_>,
        ys: &[Q8Row<'_>],
        stride: usize,
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        configure_thread();
        // Left uninitialised (zeroing it took a tenth of the kernel's time): a block's weights are written by
        // `unpack` and its sums by `product` before they are read.
        let mut scratch = MaybeUninit::<Scratch>::uninit();
        let weights = addr_of_mut!((*scratch.as_mut_ptr()).weights).cast::<[u8; B_BYTES]>();
        let sums = addr_of_mut!((*scratch.as_mut_ptr()).sums).cast::<Sums>();
        let a = ys[0].qs.as_ptr() as *const i8;
        let nb = w.blocks();
        // Three stages in flight: block b's float terms, b + 1's tile product, b + 2's unpacking (measured: any
        // distance beyond took the same time). A tile load right after the stores of its weights waits for them to
        // reach the cache, and vector loads right after a tile store wait for it.
        unpack::<FIVE>(w, 0, weights.cast());
        product(a, 0, stride, weights.cast(), sums.cast());
        if nb > 1 {
            unpack::<FIVE>(w, 1, weights.add(1).cast());
        }
        let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
        for b in 0..nb {
            let k = b & 1;
            prefetch_ahead(w.qs.as_ptr(), b, BLOCK_QS);
            if b + 1 < nb {
                let (next_weights, next_sums) = (weights.add(k ^ 1), sums.add(k ^ 1));
                product(a, b + 1, stride, next_weights.cast(), next_sums.cast());
            }
            // Into the buffer block b's product read, one iteration ago.
            if b + 2 < nb {
                unpack::<FIVE>(w, b + 2, weights.add(k).cast());
            }
            let sums = sums.add(k).cast::<i32>().cast_const();
            let at = b * GROUP_ROWS;
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(at) as *const __m256i));
            let wm = _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(at) as *const __m256i));
            each_row!(TILE_ROWS, |r| {
                let sumi = _mm512_load_si512(sums.add(r * GROUP_ROWS) as *const __m512i);
                let y = (ys[r].d[b], ys[r].s[b]);
                acc[r] = super::avx512_vnni::block_terms(acc[r], sumi, (wd, wm), y);
            });
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), acc);
        }
    }

    /// Block `b`'s weights unpacked into `weights` in the layout of the tile's `B`: part `p`'s low nibbles (values
    /// `4p..4p + 4` of every weight row) are its row `p`, its high nibbles (values `4p + 16..4p + 20`) row `p + 4`
    /// (with their fifth bits when `FIVE`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack<const FIVE: bool>(w: Q4_1Group<'_>, b: usize, weights: *mut u8) {
        let base = w.qs.as_ptr().add(b * BLOCK_QS);
        let q = super::avx512_vnni::unpack::<FIVE>(w, b, base, _mm512_set1_epi8(0x0F));
        for (p, q) in q.into_iter().enumerate() {
            _mm512_store_si512(weights.add(p * 64) as *mut __m512i, q);
        }
    }

    /// Block `b`'s integer sums for the tile's rows (`a`: the first row's blocks, rows `stride` bytes apart)
    /// against its unpacked `weights`, into `sums`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn product(a: *const i8, b: usize, stride: usize, weights: *const u8, sums: *mut i32) {
        signed_by_unsigned(a.add(b * QK8_1), stride, weights, sums);
    }
}

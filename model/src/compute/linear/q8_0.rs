//! Q8_0 weights (most often a tied LM head: SmolLM2's `token_embd`) multiplied by f32 activations with our own
//! kernels, on our own thread pool.
//!
//! Candle's thread pool was the first cost: its workers spin between matmuls on the same cores as ours, so every
//! decode step that ended in candle's LM head paid for them in the next step's blocks. Its kernel was the second:
//! one weight row at a time, a horizontal sum per row. Here weights are repacked at load time into groups of
//! [`GROUP_ROWS`] interleaved rows (as [`super::q4_1`] does), each vector lane a different row, and the product gives
//! candle's result bit for bit: candle's AVX2 `vec_dot_q8_0_q8_0` keeps eight lanes per row, lane `l` summing the
//! products of bytes `4l..4l + 4` of each block and adding `d_w * d_x * sum` to itself (fused), then sums the lanes
//! pairwise. Our kernels keep the same eight sums per row, one vector per `l` with a row in each lane. (On CPUs with
//! AVX-VNNI, candle takes a repacked kernel instead for rows whose length is a multiple of 256, with sums in
//! another order; SmolLM2's 576 is not.)
//!
//! That order is what blocks of a quantized model need: the next matmul requantizes their output, and any other
//! rounding moves a model's logits visibly. An LM head's output is not requantized, so it may take
//! [`Summation::Blocks`]: each block's 32 products summed in integers (exactly), and one fused `d_w * d_x * sum` per
//! block and row, not eight. A result within float rounding of candle's (closer to the exact one, in fact), for an
//! eighth of the float work, and with one sum per row a tile takes eight activation rows instead of two.
use super::q8_1::{abs_max, round_half_away};
use super::{interleaved, GROUP_ROWS, PART_BYTES};
use crate::error::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

mod blocks;

/// Values per block.
pub const QK8_0: usize = 32;
/// Bytes of one ggml `block_q8_0`: scale `d` (half), 32 signed bytes.
const BLOCK_BYTES: usize = 2 + QK8_0;
/// Value bytes of one block of a group: eight parts (four bytes of each row, row `k` at `4k`).
const BLOCK_QS: usize = GROUP_ROWS * QK8_0;

/// How a row's products are summed (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Summation {
    /// Candle's (and ggml's) eight float lanes per row: its result bit for bit.
    Lanes,
    /// Each block's products summed exactly in integers, then one fused multiply-add per block.
    Blocks,
}

/// A `[rows, cols]` Q8_0 weight matrix, repacked into groups of interleaved rows (rows past the last are zero).
#[derive(Debug)]
pub struct Q8_0Matrix {
    summation: Summation,
    /// `[group][block][row of the group]`.
    d: Vec<f16>,
    /// `[group][block][part][row of the group][byte]`.
    qs: super::WeightBytes<i8>,
    rows: usize,
    cols: usize,
}

/// One group's blocks: `GROUP_ROWS` scales and [`BLOCK_QS`] bytes per block.
#[derive(Debug, Clone, Copy)]
pub struct Q8_0Group<'a> {
    pub d: &'a [f16],
    pub qs: &'a [i8],
}

impl Q8_0Group<'_> {
    pub fn blocks(&self) -> usize {
        self.d.len() / GROUP_ROWS
    }
}

/// Activations quantized to Q8_0 blocks as candle's `BlockQ8_0::from_float` does.
#[derive(Debug)]
pub struct Q8_0Rows {
    blocks: usize,
    /// The f32 values of the blocks' half-precision scales.
    d: Vec<f32>,
    qs: Vec<[i8; QK8_0]>,
    /// `-128` times the sum of each four bytes: what a product with weights offset by 128 (unsigned, as `dpbusd`
    /// takes them) has too much.
    offset: Vec<[i32; QK8_0 / 4]>,
    /// The same for each whole block.
    block_offset: Vec<i32>,
}

/// One row of [`Q8_0Rows`].
#[derive(Debug, Clone, Copy)]
pub struct Q8_0Row<'a> {
    pub d: &'a [f32],
    pub qs: &'a [[i8; QK8_0]],
    pub offset: &'a [[i32; QK8_0 / 4]],
    pub block_offset: &'a [i32],
}

impl Q8_0Rows {
    /// `m` rows of `x` (row-major, a multiple of 32 values each).
    pub fn quantize(x: &[f32], m: usize) -> Self {
        let blocks = x.len().checked_div(m).unwrap_or(0) / QK8_0;
        let mut q = Self {
            blocks,
            d: Vec::with_capacity(m * blocks),
            qs: Vec::with_capacity(m * blocks),
            offset: Vec::with_capacity(m * blocks),
            block_offset: Vec::with_capacity(m * blocks),
        };
        for xs in x.chunks_exact(QK8_0) {
            let d = abs_max(xs) / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let qs: [i8; QK8_0] = std::array::from_fn(|i| round_half_away(xs[i] * id) as i8);
            q.d.push(f16::from_f32(d).to_f32());
            let offset: [i32; QK8_0 / 4] = std::array::from_fn(|l| {
                -128 * qs[4 * l..4 * l + 4].iter().map(|&v| v as i32).sum::<i32>()
            });
            q.block_offset.push(offset.iter().sum());
            q.offset.push(offset);
            q.qs.push(qs);
        }
        q
    }

    pub fn row(&self, i: usize) -> Q8_0Row<'_> {
        let r = i * self.blocks..(i + 1) * self.blocks;
        Q8_0Row {
            d: &self.d[r.clone()],
            qs: &self.qs[r.clone()],
            offset: &self.offset[r.clone()],
            block_offset: &self.block_offset[r],
        }
    }
}

impl Q8_0Matrix {
    /// Repacks a Q8_0 `QTensor`; `None` for any other format or shape.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        let dims = q.shape().dims();
        if q.dtype() != GgmlDType::Q8_0 || dims.len() != 2 || !dims[1].is_multiple_of(QK8_0) {
            return Ok(None);
        }
        Ok(Some(Self::from_bytes(&q.data()?, dims[0], dims[1])?))
    }

    /// Repacks raw ggml blocks (row by row) into interleaved groups.
    pub fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        super::block_count(GgmlDType::Q8_0, data, (rows, cols))?;
        let nb = cols / QK8_0;
        let slots = rows.div_ceil(GROUP_ROWS) * nb * GROUP_ROWS;
        let mut w = Self {
            summation: Summation::Lanes,
            d: vec![f16::ZERO; slots],
            qs: super::WeightBytes::zeroed(slots * QK8_0),
            rows,
            cols,
        };
        for (i, b) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let (at, k) = interleaved(i / nb, i % nb, nb);
            w.d[at * GROUP_ROWS + k] = f16::from_le_bytes([b[0], b[1]]);
            for (l, bytes) in b[2..].chunks_exact(4).enumerate() {
                let q0 = at * BLOCK_QS + l * PART_BYTES + 4 * k;
                for (q, &v) in w.qs[q0..q0 + 4].iter_mut().zip(bytes) {
                    *q = v as i8;
                }
            }
        }
        Ok(w)
    }

    /// The same matrix summing its products in `summation`'s order.
    pub fn with_summation(self, summation: Summation) -> Self {
        Self { summation, ..self }
    }

    pub fn summation(&self) -> Summation {
        self.summation
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn group(&self, g: usize) -> Q8_0Group<'_> {
        let per_group = self.cols / QK8_0 * GROUP_ROWS;
        Q8_0Group {
            d: &self.d[g * per_group..(g + 1) * per_group],
            qs: &self.qs[g * per_group * QK8_0..(g + 1) * per_group * QK8_0],
        }
    }

    /// `x` (`[m, cols]`, row-major) times the transpose of this matrix: `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, m)
    }

    /// [`Self::matmul`] with a chosen kernel (tests compare kernels).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.cols);
        let xq = Q8_0Rows::quantize(x, m);
        let rows: Vec<Q8_0Row<'_>> = (0..m).map(|i| xq.row(i)).collect();
        super::matmul_by_groups(self.rows, m, |g, tile, out| {
            kernel.group_dots(self.summation, self.group(g), &rows[tile], out)
        })
    }
}

/// The dot product kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AMX tiles for sixteen rows at a time summed by blocks (an LM head); the 512-bit kernel otherwise.
    #[cfg(target_arch = "x86_64")]
    Amx,
}

impl Kernel {
    /// Every kernel this CPU can run, slowest first (tests check each).
    pub fn available() -> Vec<Self> {
        let mut all = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = super::cpu_features();
            if cpu.avx2 {
                all.push(Kernel::Avx2);
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
            let cpu = super::cpu_features();
            if cpu.amx {
                return Kernel::Amx;
            }
            if cpu.avx512_vnni {
                return Kernel::Avx512Vnni;
            }
            if cpu.avx2 {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// `out[r][k] = dot(row k of w, xs[r])` for every activation row, each as long as `w`'s rows, summed in
    /// `summation`'s order.
    pub fn group_dots(
        self,
        summation: Summation,
        w: Q8_0Group<'_>,
        xs: &[Q8_0Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let nb = w.blocks();
        assert!(xs.iter().all(|x| x.d.len() == nb && x.qs.len() == nb) && out.len() >= xs.len());
        match (self, summation) {
            (Kernel::Scalar, Summation::Lanes) => group_scalar(w, xs, out),
            (Kernel::Scalar, Summation::Blocks) => blocks::group_scalar(w, xs, out),
            // SAFETY (all): `available` lists a kernel only on CPUs with its features; lengths were checked above.
            #[cfg(target_arch = "x86_64")]
            (Kernel::Avx2, Summation::Lanes) => unsafe { avx2::group_dots(w, xs, out) },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Avx2, Summation::Blocks) => unsafe { blocks::avx2::group_dots(w, xs, out) },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Avx512Vnni | Kernel::Amx, Summation::Lanes) => unsafe {
                avx512_vnni::group_dots(w, xs, out)
            },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Avx512Vnni, Summation::Blocks) => unsafe {
                blocks::avx512_vnni::group_dots(w, xs, out)
            },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Amx, Summation::Blocks) => unsafe { blocks::amx::group_dots(w, xs, out) },
        }
    }
}

/// Candle's AVX2 order in scalar code: lane `l` sums the products of bytes `4l..4l + 4`, each block adds
/// `d_w * d_x * lane` to the lane's running sum (fused), and the lanes are summed pairwise as `hsum_float_8` does.
fn group_scalar(w: Q8_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (k, o) in o.iter_mut().enumerate() {
            let mut acc = [0f32; QK8_0 / 4];
            for b in 0..w.blocks() {
                let d = w.d[b * GROUP_ROWS + k].to_f32() * x.d[b];
                for (l, a) in acc.iter_mut().enumerate() {
                    let at = b * BLOCK_QS + l * PART_BYTES + 4 * k;
                    let sumi: i32 = (0..4)
                        .map(|t| w.qs[at + t] as i32 * x.qs[b][4 * l + t] as i32)
                        .sum();
                    *a = d.mul_add(sumi as f32, *a);
                }
            }
            *o = hsum_lanes(acc);
        }
    }
}

/// Eight float lanes summed in the order of an AVX2 horizontal sum (`_mm256` halves, then pairs, then the two
/// left).
pub(super) fn hsum_lanes(a: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| a[i + 4] + a[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Eight lanes (weight rows) per vector: the group in two halves, one activation row at a time (its eight sums
/// per row take eight registers).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::{Q8_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, PART_BYTES};
    use std::arch::x86_64::*;

    const LANES: usize = 8;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q8_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
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
                    for (l, a) in acc.iter_mut().enumerate() {
                        let bw = _mm256_loadu_si256(base.add(l * PART_BYTES) as *const __m256i);
                        *a = add_lane(*a, d, bw, xq.add(l).read_unaligned());
                    }
                }
                _mm256_storeu_ps(o.as_mut_ptr().add(half * LANES), hsum(&acc));
            }
        }
    }

    /// `acc + d * sums` (fused), `sums` holding in each lane (weight row) the exact sum of the products of its four
    /// signed weight bytes in `bw` and the four signed activation bytes `x`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::compute::linear) unsafe fn add_lane(
        acc: __m256,
        d: __m256,
        bw: __m256i,
        x: i32,
    ) -> __m256 {
        let bx = _mm256_set1_epi32(x);
        // Signed bytes times signed bytes: the weight's sign moves onto the activation.
        let products = _mm256_maddubs_epi16(_mm256_sign_epi8(bw, bw), _mm256_sign_epi8(bx, bw));
        let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), products));
        _mm256_fmadd_ps(d, sums, acc)
    }

    /// Each lane's eight sums added in `hsum_lanes`'s order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::compute::linear) unsafe fn hsum(a: &[__m256; 8]) -> __m256 {
        let r: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(a[i + 4], a[i]));
        _mm256_add_ps(_mm256_add_ps(r[0], r[2]), _mm256_add_ps(r[1], r[3]))
    }
}

/// Sixteen lanes per vector: the whole group, two activation rows at a time (sixteen of the thirty-two registers
/// hold their sums; each weight vector is loaded and offset once for both).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512_vnni {
    use super::{Q8_0Group, Q8_0Row, BLOCK_QS, GROUP_ROWS, PART_BYTES};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn group_dots(w: Q8_0Group<'_>, xs: &[Q8_0Row<'_>], out: &mut [[f32; GROUP_ROWS]]) {
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
        w: Q8_0Group<'_>,
        xs: &[Q8_0Row<'_>],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [[_mm512_setzero_ps(); 8]; N];
        for b in 0..w.blocks() {
            let wd = _mm512_cvtph_ps(_mm256_loadu_si256(
                w.d.as_ptr().add(b * GROUP_ROWS) as *const __m256i
            ));
            let d: [__m512; N] =
                std::array::from_fn(|r| _mm512_mul_ps(wd, _mm512_set1_ps(xs[r].d[b])));
            let base = w.qs.as_ptr().add(b * BLOCK_QS);
            for l in 0..8 {
                // `dpbusd` takes unsigned weights: w + 128 (the sign bit flipped).
                let bw = _mm512_xor_si512(
                    _mm512_loadu_si512(base.add(l * PART_BYTES) as *const __m512i),
                    flip,
                );
                add_lane(&mut acc, &d, bw, (xs, b, l));
            }
        }
        store_lanes(&acc, out);
    }

    /// Lane `l` of block `b` for each of the tile's rows `xs`: the exact sum of the products of the weights `bw`
    /// (offset by 128, unsigned, as `dpbusd` takes them) and the row's four activations, the sum started at the
    /// row's `-128 * sum(x)` to take the offset back out, then added to the row's lane `l` as `d * sum` (fused).
    // `r` picks each row's scale, activations and sums alike.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub(in crate::compute::linear) unsafe fn add_lane<const N: usize>(
        acc: &mut [[__m512; 8]; N],
        d: &[__m512; N],
        bw: __m512i,
        (xs, b, l): (&[Q8_0Row<'_>], usize, usize),
    ) {
        for r in 0..N {
            let xq = (xs[r].qs.as_ptr().add(b) as *const i32)
                .add(l)
                .read_unaligned();
            let sums = _mm512_dpbusd_epi32(
                _mm512_set1_epi32(xs[r].offset[b][l]),
                bw,
                _mm512_set1_epi32(xq),
            );
            acc[r][l] = _mm512_fmadd_ps(d[r], _mm512_cvtepi32_ps(sums), acc[r][l]);
        }
    }

    /// Each row's eight lanes summed in `hsum_lanes`'s order, into its outputs.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub(in crate::compute::linear) unsafe fn store_lanes<const N: usize>(
        acc: &[[__m512; 8]; N],
        out: &mut [[f32; GROUP_ROWS]],
    ) {
        for (a, o) in acc.iter().zip(out.iter_mut()) {
            let h: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(a[i + 4], a[i]));
            _mm512_storeu_ps(
                o.as_mut_ptr(),
                _mm512_add_ps(_mm512_add_ps(h[0], h[2]), _mm512_add_ps(h[1], h[3])),
            );
        }
    }
}

matmul_op!(Q8_0Matrix, "petal-q8_0-matmul");

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;

    use super::super::{candle_product, test_matrix as random};

    #[test]
    fn every_kernel_equals_candle_bit_for_bit() {
        // 131 weight rows: eight full groups and a partial one. 576 columns, as SmolLM2's head: candle's vec_dot on
        // every x86 CPU (its VNNI repacking takes only multiples of 256).
        let q = QTensor::quantize(&random(131, 576, 3), GgmlDType::Q8_0).unwrap();
        let ours = Q8_0Matrix::from_qtensor(&q).unwrap().unwrap();
        let candle = QMatMul::from_qtensor(q).unwrap();
        for rows in [1, 2, 5, 17] {
            let x = random(rows, 576, rows as u64);
            let (want, xs) = candle_product(&candle, &x);
            for kernel in Kernel::available() {
                let got = ours.matmul_with(kernel, &xs, rows);
                assert_eq!(got, want, "{kernel:?}, {rows} rows");
            }
        }
    }

    #[test]
    fn summed_by_blocks_every_kernel_equals_the_reference_and_candle_to_rounding() {
        // Whole tiles of eight activation rows (sixteen on AMX) and every remainder.
        let q = QTensor::quantize(&random(131, 576, 5), GgmlDType::Q8_0).unwrap();
        let ours = Q8_0Matrix::from_qtensor(&q)
            .unwrap()
            .unwrap()
            .with_summation(Summation::Blocks);
        let candle = QMatMul::from_qtensor(q).unwrap();
        for rows in [1, 2, 3, 4, 5, 6, 8, 9, 12, 14, 15, 16, 17, 23, 35] {
            let x = random(rows, 576, 7 + rows as u64);
            let (want, xs) = candle_product(&candle, &x);
            let reference = ours.matmul_with(Kernel::Scalar, &xs, rows);
            // Eight float lanes against exact block sums: float rounding apart, the same.
            let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in reference.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-6 * largest,
                    "{rows} rows: {a} against {b}"
                );
            }
            assert_ne!(
                reference, want,
                "{rows} rows: the orders should round differently"
            );
            for kernel in Kernel::available() {
                let got = ours.matmul_with(kernel, &xs, rows);
                assert_eq!(got, reference, "{kernel:?}, {rows} rows");
            }
        }
    }

    #[test]
    fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_widths() {
        let q = QTensor::quantize(&random(16, 64, 1), GgmlDType::Q8_0).unwrap();
        let m = Q8_0Matrix::from_qtensor(&q).unwrap().unwrap();
        super::super::assert_op_shapes(&m, 16, 64);
        assert!(Q8_0Matrix::from_bytes(&[0; 33], 1, 32).is_err());
        let q4 = QTensor::quantize(&random(16, 64, 1), GgmlDType::Q4_0).unwrap();
        assert!(Q8_0Matrix::from_qtensor(&q4).unwrap().is_none());
    }
}

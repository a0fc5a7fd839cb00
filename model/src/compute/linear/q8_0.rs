//! Q8_0 weights (most often a tied LM head: SmolLM2's `token_embd`) multiplied by f32 activations on our own thread
//! pool.
//!
//! Candle's kernel is fine; its thread pool is the cost. Its workers spin between matmuls on the same cores as
//! ours, so every decode step that ended in candle's LM head paid for them in the next step's blocks. Here the
//! product runs on rayon, like every other kernel of a step, and gives candle's result bit for bit: the AVX2
//! kernel is its `vec_dot_q8_0_q8_0` (eight lanes of integer sums, one fused multiply-add per block, the same
//! horizontal sum), and the scalar one follows the same lanes and order. (On CPUs with AVX-VNNI, candle takes a
//! repacked kernel instead for rows whose length is a multiple of 256, with sums in another order; SmolLM2's 576
//! is not.)
use super::dot::hsum_lanes;
use crate::error::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use half::f16;
use rayon::prelude::*;

/// Values per block.
pub const QK8_0: usize = 32;
/// Bytes of one ggml `block_q8_0`: scale `d` (half), 32 signed bytes.
const BLOCK_BYTES: usize = 2 + QK8_0;
/// Weight rows handled by one task.
const WEIGHT_ROWS_PER_TASK: usize = 64;

/// Rows of Q8_0 blocks: the weights (scales as halves, as in the file) or quantized activations.
#[derive(Debug)]
pub struct Q8_0Matrix {
    d: Vec<f16>,
    qs: Vec<[i8; QK8_0]>,
    rows: usize,
    cols: usize,
}

/// One row's blocks.
#[derive(Debug, Clone, Copy)]
pub struct Q8_0Row<'a> {
    pub d: &'a [f16],
    pub qs: &'a [[i8; QK8_0]],
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

    /// Raw ggml blocks, row by row.
    pub fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let n = super::block_count("Q8_0", data, (rows, cols), (QK8_0, BLOCK_BYTES))?;
        let mut w = Self {
            d: Vec::with_capacity(n),
            qs: Vec::with_capacity(n),
            rows,
            cols,
        };
        for b in data.chunks_exact(BLOCK_BYTES) {
            w.d.push(f16::from_le_bytes([b[0], b[1]]));
            w.qs.push(std::array::from_fn(|i| b[2 + i] as i8));
        }
        Ok(w)
    }

    /// `m` rows of `x` (row-major, `cols` values each) quantized as candle's `BlockQ8_0::from_float` does.
    pub fn quantize(x: &[f32], m: usize, cols: usize) -> Self {
        let n = m * cols / QK8_0;
        let mut q = Self {
            d: Vec::with_capacity(n),
            qs: Vec::with_capacity(n),
            rows: m,
            cols,
        };
        for xs in x.chunks_exact(QK8_0) {
            let amax = xs.iter().fold(0f32, |a, x| a.max(x.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            q.d.push(f16::from_f32(d));
            q.qs.push(std::array::from_fn(|i| (xs[i] * id).round() as i8));
        }
        q
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn row(&self, r: usize) -> Q8_0Row<'_> {
        let per_row = self.cols / QK8_0;
        let i = r * per_row..(r + 1) * per_row;
        Q8_0Row {
            d: &self.d[i.clone()],
            qs: &self.qs[i],
        }
    }

    /// `x` (`[m, cols]`, row-major) times the transpose of this matrix: `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, m)
    }

    /// [`Self::matmul`] with a chosen kernel (tests compare kernels).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
        let n = self.rows;
        let xq = Self::quantize(x, m, self.cols);
        // Tasks own whole weight rows; the output is transposed into place afterwards when there are several
        // activation rows (one row, every decode step, needs no transpose).
        let mut by_weight = vec![0f32; n * m];
        by_weight
            .par_chunks_mut(WEIGHT_ROWS_PER_TASK * m)
            .enumerate()
            .for_each(|(task, dst)| {
                let first = task * WEIGHT_ROWS_PER_TASK;
                for (j, o) in dst.chunks_exact_mut(m).enumerate() {
                    let w = self.row(first + j);
                    for (i, o) in o.iter_mut().enumerate() {
                        *o = kernel.dot(w, xq.row(i));
                    }
                }
            });
        if m == 1 {
            return by_weight;
        }
        let mut out = vec![0f32; m * n];
        for (j, col) in by_weight.chunks_exact(m).enumerate() {
            for (i, v) in col.iter().enumerate() {
                out[i * n + j] = *v;
            }
        }
        out
    }
}

/// The dot product kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Kernel {
    /// Every kernel this CPU can run (tests check each).
    pub fn available() -> Vec<Self> {
        let mut all = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            all.push(Kernel::Avx2);
        }
        all
    }

    pub fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| Self::available().pop().unwrap_or(Kernel::Scalar))
    }

    /// `dot(w, x)`, both rows of the same number of blocks.
    pub fn dot(self, w: Q8_0Row<'_>, x: Q8_0Row<'_>) -> f32 {
        assert_eq!(w.d.len(), x.d.len());
        match self {
            Kernel::Scalar => dot_scalar(w, x),
            // SAFETY: `available` lists this kernel only on CPUs with AVX2 and FMA; lengths were checked above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::dot(w, x) },
        }
    }
}

/// Candle's AVX2 order in scalar code: lane `l` sums the products of bytes `4l..4l + 4`, each block adds
/// `d_w * d_x * lane` to the lane's running sum (fused), and the lanes are summed pairwise as `hsum_float_8` does.
pub fn dot_scalar(w: Q8_0Row<'_>, x: Q8_0Row<'_>) -> f32 {
    let mut acc = [0f32; 8];
    for i in 0..w.d.len() {
        let d = w.d[i].to_f32() * x.d[i].to_f32();
        for (l, a) in acc.iter_mut().enumerate() {
            let sumi: i32 = (4 * l..4 * l + 4)
                .map(|b| w.qs[i][b] as i32 * x.qs[i][b] as i32)
                .sum();
            *a = d.mul_add(sumi as f32, *a);
        }
    }
    hsum_lanes(acc)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Q8_0Row;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: Q8_0Row<'_>, x: Q8_0Row<'_>) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for i in 0..w.d.len() {
            let d = _mm256_set1_ps(w.d[i].to_f32() * x.d[i].to_f32());
            let bw = _mm256_loadu_si256(w.qs.as_ptr().add(i) as *const __m256i);
            let bx = _mm256_loadu_si256(x.qs.as_ptr().add(i) as *const __m256i);
            // Signed bytes times signed bytes: the weight's sign moves onto the activation.
            let products = _mm256_maddubs_epi16(_mm256_sign_epi8(bw, bw), _mm256_sign_epi8(bx, bw));
            let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), products));
            acc = _mm256_fmadd_ps(d, lanes, acc);
        }
        let r = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
        let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        let r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }
}

impl CustomOp1 for Q8_0Matrix {
    fn name(&self) -> &'static str {
        "petal-q8_0-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = (self.rows, self.cols);
        super::cpu_matmul("q8_0 matmul", dims, storage, layout, |x, m| {
            self.matmul(x, m)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Tensor};

    use super::super::{candle_product, test_matrix as random};

    #[test]
    fn every_kernel_equals_candle_bit_for_bit() {
        // 131 weight rows: two full tasks and a partial one. 576 columns, as SmolLM2's head: candle's vec_dot on
        // every x86 CPU (its VNNI repacking takes only multiples of 256).
        let q = QTensor::quantize(&random(131, 576, 3), GgmlDType::Q8_0).unwrap();
        let ours = Q8_0Matrix::from_qtensor(&q).unwrap().unwrap();
        let candle = QMatMul::from_qtensor(q).unwrap();
        for rows in [1, 2, 5] {
            let x = random(rows, 576, rows as u64);
            let (want, xs) = candle_product(&candle, &x);
            for kernel in Kernel::available() {
                let got = ours.matmul_with(kernel, &xs, rows);
                assert_eq!(got, want, "{kernel:?}, {rows} rows");
            }
        }
    }

    #[test]
    fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_widths() {
        let q = QTensor::quantize(&random(16, 64, 1), GgmlDType::Q8_0).unwrap();
        let m = Q8_0Matrix::from_qtensor(&q).unwrap().unwrap();
        let x = Tensor::zeros((2, 3, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(x.apply_op1_no_bwd(&m).unwrap().dims(), &[2, 3, 16]);
        let bad = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(bad.apply_op1_no_bwd(&m).is_err());
        assert!(Q8_0Matrix::from_bytes(&[0; 33], 1, 32).is_err());
        let q4 = QTensor::quantize(&random(16, 64, 1), GgmlDType::Q4_0).unwrap();
        assert!(Q8_0Matrix::from_qtensor(&q4).unwrap().is_none());
    }
}

//! Q4_1 weights repacked by field at load time (scales, minimums and nibbles each contiguous per row, the same
//! bytes as the GGUF's blocks) and multiplied by f32 activations with our own kernels ([`super::dot`]): a tiled
//! matmul that reads each weight block once per four activation rows.
use super::dot::Kernel;
use super::q8_1::{Q8Row, Q8Rows, QK8_1};
use crate::error::{ModelError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use half::f16;
use rayon::prelude::*;

/// Values per block.
pub const QK4_1: usize = 32;
/// Bytes of one ggml `block_q4_1`: scale `d`, minimum `m` (halves), 16 bytes of nibbles (`value = d * q + m`).
const BLOCK_BYTES: usize = 20;

/// Weight rows handled by one task, and activation rows kept hot in cache while they are.
const WEIGHT_ROWS_PER_TASK: usize = 16;
const ACTIVATION_ROWS_PER_TILE: usize = 64;

/// A `[rows, cols]` Q4_1 matrix (`cols` a multiple of 32), as `y = x W^T`'s `W`.
#[derive(Debug)]
pub struct Q4_1Matrix {
    d: Vec<f16>,
    m: Vec<f16>,
    qs: Vec<[u8; QK4_1 / 2]>,
    rows: usize,
    cols: usize,
}

/// One weight row's blocks, by field.
#[derive(Debug, Clone, Copy)]
pub struct Q4_1Row<'a> {
    pub d: &'a [f16],
    pub m: &'a [f16],
    pub qs: &'a [[u8; QK4_1 / 2]],
}

impl Q4_1Matrix {
    /// Repacks a Q4_1 `QTensor`; `None` for any other format or shape.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        let dims = q.shape().dims();
        if q.dtype() != GgmlDType::Q4_1 || dims.len() != 2 || !dims[1].is_multiple_of(QK4_1) {
            return Ok(None);
        }
        let data = q.data()?;
        Ok(Some(Self::from_bytes(&data, dims[0], dims[1])?))
    }

    /// Repacks raw ggml blocks, row by row.
    pub fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let n = super::block_count("Q4_1", data, (rows, cols), (QK4_1, BLOCK_BYTES))?;
        let mut w = Self {
            d: Vec::with_capacity(n),
            m: Vec::with_capacity(n),
            qs: Vec::with_capacity(n),
            rows,
            cols,
        };
        for b in data.chunks_exact(BLOCK_BYTES) {
            w.d.push(f16::from_le_bytes([b[0], b[1]]));
            w.m.push(f16::from_le_bytes([b[2], b[3]]));
            let mut qs = [0u8; QK4_1 / 2];
            qs.copy_from_slice(&b[4..]);
            w.qs.push(qs);
        }
        Ok(w)
    }

    /// The rows of several matrices of the same width, one after another: one matmul instead of several over
    /// the same input (queries, keys and values; gate and up).
    pub fn concat_rows(parts: &[&Q4_1Matrix]) -> Result<Self> {
        let cols = parts.first().map(|p| p.cols).unwrap_or(0);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(ModelError::Config(
                "Q4_1 matrices of different widths cannot be stacked".into(),
            ));
        }
        Ok(Self {
            d: parts.iter().flat_map(|p| p.d.iter().copied()).collect(),
            m: parts.iter().flat_map(|p| p.m.iter().copied()).collect(),
            qs: parts.iter().flat_map(|p| p.qs.iter().copied()).collect(),
            rows: parts.iter().map(|p| p.rows).sum(),
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn row(&self, r: usize) -> Q4_1Row<'_> {
        let per_row = self.cols / QK4_1;
        let i = r * per_row..(r + 1) * per_row;
        Q4_1Row {
            d: &self.d[i.clone()],
            m: &self.m[i.clone()],
            qs: &self.qs[i],
        }
    }

    /// The matrix as f32, row-major: ggml's `dequantize_row_q4_1`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for ((d, m), qs) in self.d.iter().zip(&self.m).zip(&self.qs) {
            let (d, m) = (d.to_f32(), m.to_f32());
            out.extend(qs.iter().map(|q| (q & 0x0F) as f32 * d + m));
            out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
        }
        out
    }

    /// `x` (`[m, cols]`, row-major) times the transpose of this matrix: `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, m)
    }

    /// [`Self::matmul`] with a chosen kernel (tests compare kernels).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
        let n = self.rows;
        debug_assert_eq!(x.len(), m * self.cols);
        debug_assert_eq!(self.cols % QK8_1, 0);
        let xq = Q8Rows::quantize(x, m);
        let rows: Vec<Q8Row<'_>> = (0..m).map(|i| xq.row(i)).collect();
        // Each task owns WEIGHT_ROWS_PER_TASK output columns of every row.
        let mut out = vec![0f32; m * n];
        let dst = SharedOut(out.as_mut_ptr());
        let tasks = n.div_ceil(WEIGHT_ROWS_PER_TASK);
        (0..tasks).into_par_iter().for_each(|task| {
            let first = task * WEIGHT_ROWS_PER_TASK;
            let cols = first..(first + WEIGHT_ROWS_PER_TASK).min(n);
            let mut col = [0f32; ACTIVATION_ROWS_PER_TILE];
            for tile in (0..m).step_by(ACTIVATION_ROWS_PER_TILE) {
                let ys = &rows[tile..(tile + ACTIVATION_ROWS_PER_TILE).min(m)];
                for j in cols.clone() {
                    kernel.dot_rows(self.row(j), ys, &mut col);
                    for (i, v) in col[..ys.len()].iter().enumerate() {
                        // SAFETY: `(tile + i) * n + j` is inside `out` (tile + i < m, j < n), and column `j`
                        // belongs to this task alone, so no two tasks write the same element.
                        unsafe { dst.write((tile + i) * n + j, *v) };
                    }
                }
            }
        });
        out
    }
}

/// The output buffer, shared by tasks that write disjoint columns.
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements and the buffer outlives the parallel loop that uses it.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    unsafe fn write(&self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }
}

impl CustomOp1 for Q4_1Matrix {
    fn name(&self) -> &'static str {
        "petal-q4_1-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = (self.rows, self.cols);
        super::cpu_matmul("q4_1 matmul", dims, storage, layout, |x, m| {
            self.matmul(x, m)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{QMatMul, QTensor};
    use candle_core::{Device, Tensor};

    use super::super::{candle_product, test_matrix as random};

    fn q4_1(rows: usize, cols: usize) -> (QTensor, Q4_1Matrix) {
        let q = QTensor::quantize(&random(rows, cols, 7), GgmlDType::Q4_1).unwrap();
        let m = Q4_1Matrix::from_qtensor(&q).unwrap().unwrap();
        (q, m)
    }

    #[test]
    fn dequantizes_bit_for_bit_like_candle() {
        let (q, m) = q4_1(37, 96);
        let want = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let got = m.dequantize();
        assert_eq!(got.len(), want.len());
        assert!(got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn every_kernel_equals_candle_bit_for_bit() {
        // 37 weight rows: two full tasks and a partial one; activation rows around the 4-row and 64-row tiles.
        // 37 weight rows of 13 blocks: groups of eight blocks and a tail.
        let (q, m) = q4_1(37, 416);
        let candle = QMatMul::from_qtensor(q).unwrap();
        for rows in [1, 3, 4, 5, 67] {
            let x = random(rows, 416, rows as u64);
            let (want, xs) = candle_product(&candle, &x);
            for kernel in Kernel::available() {
                let got = m.matmul_with(kernel, &xs, rows);
                assert_eq!(got, want, "{kernel:?}, {rows} rows");
            }
        }
    }

    #[test]
    fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_widths() {
        let (_, m) = q4_1(16, 64);
        let x = Tensor::zeros((2, 3, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        let y = x.apply_op1_no_bwd(&m).unwrap();
        assert_eq!(y.dims(), &[2, 3, 16]);
        let bad = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(bad.apply_op1_no_bwd(&m).is_err());
        assert!(Q4_1Matrix::from_bytes(&[0; 19], 1, 32).is_err());
    }
}

//! Q5_1 weights repacked at load time and multiplied by Q4_1's kernels ([`super::q4_1::Kernel`]), which add the fifth
//! bits in as they unpack a block. Candle has no vectorised Q5_1 product (its generic scalar loop, one weight row at
//! a time), yet Q5_1 is most of what llama.cpp's `Q5_K_M` holds for models whose width is not a multiple of 256.
//!
//! A block is a Q4_1 block (scale `d`, minimum `m`, sixteen bytes of low nibbles) and 32 fifth bits, and its value
//! `j` is `d * q_j + m` as in Q4_1, `q_j` now up to 31; both formats pair with Q8_1 activations and sum a block as
//! `sumi * d_w * d_y + m_w * s_y`. So the low four bits, scales and minimums are a [`Q4_1Matrix`] and the fifth bits
//! Q5_0's masks ([`super::fifth_bits`]).
use super::fifth_bits::{self, BLOCK_MASKS};
use super::q4_1::{self, Kernel, Q4_1Group, Q4_1Matrix};
use super::{interleaved, Repacked, GROUP_ROWS};
use crate::error::Result;
use candle_core::quantized::GgmlDType;
use half::f16;

/// Values per block.
pub const QK5_1: usize = 32;
/// Bytes of one ggml `block_q5_1`: scale `d`, minimum `m` (halves), the fifth bits `qh` (32, little-endian), 16
/// bytes of nibbles (`value = d * q + m`).
const BLOCK_BYTES: usize = 24;
/// Bytes of the same block as Q4_1's, without `qh`.
const Q4_1_BLOCK_BYTES: usize = 20;

/// A `[rows, cols]` Q5_1 matrix (`cols` a multiple of 32), as `y = x W^T`'s `W`.
#[derive(Debug)]
pub struct Q5_1Matrix {
    /// The low four bits, scales and minimums.
    low: Q4_1Matrix,
    /// `[group][block][part]`.
    high: Vec<u64>,
}

impl Q5_1Matrix {
    fn group(&self, g: usize) -> Q4_1Group<'_> {
        let per_group = self.cols() / QK5_1 * BLOCK_MASKS;
        Q4_1Group {
            high: &self.high[g * per_group..(g + 1) * per_group],
            ..self.low.group(g)
        }
    }

    /// The matrix as f32, row-major: ggml's `dequantize_row_q5_1`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows() * self.cols());
        for b in self.to_bytes().chunks_exact(BLOCK_BYTES) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let value = |q: u8, j: usize| (q as u32 | ((qh >> j) & 1) << 4) as f32 * d + m;
            out.extend(b[8..].iter().enumerate().map(|(j, q)| value(q & 0x0F, j)));
            out.extend(
                b[8..]
                    .iter()
                    .enumerate()
                    .map(|(j, q)| value(q >> 4, j + 16)),
            );
        }
        out
    }

    /// `x` (`[m, cols]`, row-major) times the transpose of this matrix: `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, m)
    }

    /// [`Self::matmul`] with a chosen kernel (tests compare kernels).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.cols());
        q4_1::matmul_groups(kernel, self.rows(), (x, m), |g| self.group(g))
    }
}

impl Repacked for Q5_1Matrix {
    const DTYPE: GgmlDType = GgmlDType::Q5_1;

    fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        super::block_count(Self::DTYPE, data, (rows, cols))?;
        let nb = cols / QK5_1;
        let mut high = vec![0; rows.div_ceil(GROUP_ROWS) * nb * BLOCK_MASKS];
        let mut low = Vec::with_capacity(data.len() / BLOCK_BYTES * Q4_1_BLOCK_BYTES);
        for (i, b) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            fifth_bits::put(&mut high, interleaved(i / nb, i % nb, nb), qh);
            low.extend_from_slice(&b[..4]);
            low.extend_from_slice(&b[8..]);
        }
        Ok(Self {
            low: Q4_1Matrix::from_bytes(&low, rows, cols)?,
            high,
        })
    }

    fn to_bytes(&self) -> Vec<u8> {
        let nb = self.cols() / QK5_1;
        let low = self.low.to_bytes();
        let mut out = Vec::with_capacity(low.len() / Q4_1_BLOCK_BYTES * BLOCK_BYTES);
        for (i, b) in low.chunks_exact(Q4_1_BLOCK_BYTES).enumerate() {
            out.extend_from_slice(&b[..4]);
            let qh = fifth_bits::get(&self.high, interleaved(i / nb, i % nb, nb));
            out.extend(qh.to_le_bytes());
            out.extend_from_slice(&b[4..]);
        }
        out
    }

    fn rows(&self) -> usize {
        self.low.rows()
    }

    fn cols(&self) -> usize {
        self.low.cols()
    }
}

matmul_op!(Q5_1Matrix, "petal-q5_1-matmul");

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::Device;

    use super::super::test_matrix as random;

    fn q5_1(rows: usize, cols: usize) -> (QTensor, Q5_1Matrix) {
        let q = QTensor::quantize(&random(rows, cols, 7), GgmlDType::Q5_1).unwrap();
        let m = Q5_1Matrix::from_qtensor(&q).unwrap().unwrap();
        (q, m)
    }

    #[test]
    fn dequantizes_bit_for_bit_like_candle() {
        let (q, m) = q5_1(37, 96);
        super::super::assert_dequantizes_like_candle(&q, &m.dequantize());
    }

    #[test]
    fn every_kernel_equals_candle_bit_for_bit() {
        // As for Q4_1 (the same kernels): 37 weight rows (two full groups and a partial one); activation rows
        // around the 8-row, 16-row and 64-row tiles, with every remainder of an 8-row tile; widths of an even
        // number of blocks (candle's Q5_1 product asserts it in debug builds), two blocks up.
        super::super::assert_every_kernel_equals_candle(
            &Kernel::available(),
            (
                &[448, 64, 128],
                &[1, 2, 3, 4, 5, 6, 7, 8, 11, 15, 16, 17, 25, 40, 67],
            ),
            7,
            Q5_1Matrix::matmul_with,
        );
    }

    #[test]
    fn every_fifth_bit_reaches_its_value_and_the_sums_stay_exact() {
        // One weight row per fifth bit set alone, so a bit that went to the wrong part or lane changes one output;
        // then rows of all 31s against activations of one sign, the largest sums a block can make (the 256-bit
        // kernels' 16-bit partial sums must not saturate).
        let cols = 64;
        let mut data = vec![];
        for row in 0..34 {
            for block in 0..cols / QK5_1 {
                data.extend(f16::from_f32(0.5 + block as f32).to_le_bytes());
                data.extend(f16::from_f32(-0.25).to_le_bytes());
                let qh: u32 = match row {
                    32 | 33 => u32::MAX,
                    j => 1 << j,
                };
                data.extend(qh.to_le_bytes());
                match row {
                    32 | 33 => data.extend([0xFF; 16]),
                    _ => data.extend((0..16u8).map(|i| i.wrapping_mul(7).wrapping_add(row as u8))),
                }
            }
        }
        let mut x = random(3, cols, 11).to_vec2::<f32>().unwrap();
        x.push(vec![0.75; cols]);
        x.push(vec![-0.75; cols]);
        super::super::assert_blocks_equal_candle(
            (&data, 34, cols),
            &candle_core::Tensor::new(x, &Device::Cpu).unwrap(),
            &Kernel::available(),
            Q5_1Matrix::matmul_with,
        );
    }

    #[test]
    fn repacking_keeps_the_ggml_bytes_and_stacks_rows_exactly() {
        let (q, a) = q5_1(37, 128);
        let (_, b) = q5_1(5, 128);
        super::super::assert_repacks_and_stacks((&q, &a), &b, Q5_1Matrix::matmul);
    }

    #[test]
    fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_widths() {
        let (_, m) = q5_1(16, 64);
        super::super::assert_op_shapes(&m, 16, 64);
        assert!(Q5_1Matrix::from_bytes(&[0; 23], 1, 32).is_err());
    }
}

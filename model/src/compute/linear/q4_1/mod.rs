//! Q4_1 weights repacked at load time into groups of [`GROUP_ROWS`] interleaved rows, and multiplied by f32
//! activations with our own kernels ([`kernels`]): a tiled matmul in which every task owns one group's output
//! columns and reads each of its weight blocks once per tile of activation rows.
//!
//! Within a group, each block of 32 values is [`BLOCK_QS`] bytes: four parts, one per four bytes of a ggml block's
//! nibbles, each holding those four bytes of every row of the group one after another (row `k` at `4k`), so one
//! vector load gives every row's next four weight bytes in its own 32-bit lane. Scales and minimums are kept by
//! block, the group's rows side by side. Rows past the matrix's last (in its last group) are zero and their outputs
//! are dropped.
mod kernels;

pub use kernels::Kernel;

use super::fifth_bits::BLOCK_MASKS;
use super::{interleaved, nibbles, put_nibbles, Repacked, GROUP_ROWS, NIBBLE_BLOCK_QS, PART_BYTES};

use super::q8_1::QK8_1;
use crate::error::Result;
use candle_core::quantized::GgmlDType;
use half::f16;

/// Values per block.
pub const QK4_1: usize = 32;
/// Bytes of one ggml `block_q4_1`: scale `d`, minimum `m` (halves), 16 bytes of nibbles (`value = d * q + m`).
const BLOCK_BYTES: usize = 20;
/// Nibble bytes of one block of a group.
pub const BLOCK_QS: usize = NIBBLE_BLOCK_QS;

/// A `[rows, cols]` Q4_1 matrix (`cols` a multiple of 32), as `y = x W^T`'s `W`.
#[derive(Debug)]
pub struct Q4_1Matrix {
    /// `[group][block][row of the group]`.
    d: Vec<f16>,
    m: Vec<f16>,
    /// `[group][block][part][row of the group][byte]`.
    qs: super::WeightBytes<u8>,
    rows: usize,
    cols: usize,
}

/// One group's blocks: `d` and `m` hold `GROUP_ROWS` halves per block, `qs` [`BLOCK_QS`] bytes, and for a Q5_1
/// matrix ([`super::q5_1`]) `high` the fifth bits ([`BLOCK_MASKS`] masks a block; empty for Q4_1).
#[derive(Debug, Clone, Copy)]
pub struct Q4_1Group<'a> {
    pub d: &'a [f16],
    pub m: &'a [f16],
    pub qs: &'a [u8],
    pub high: &'a [u64],
}

impl Q4_1Group<'_> {
    pub fn blocks(&self) -> usize {
        self.d.len() / GROUP_ROWS
    }
}

impl Q4_1Matrix {
    pub(super) fn group(&self, g: usize) -> Q4_1Group<'_> {
        let per_group = self.cols / QK4_1 * GROUP_ROWS;
        let i = g * per_group..(g + 1) * per_group;
        Q4_1Group {
            d: &self.d[i.clone()],
            m: &self.m[i],
            qs: &self.qs[g * per_group * QK4_1 / 2..(g + 1) * per_group * QK4_1 / 2],
            high: &[],
        }
    }

    /// The matrix as f32, row-major: ggml's `dequantize_row_q4_1`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for b in self.to_bytes().chunks_exact(BLOCK_BYTES) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
            out.extend(b[4..].iter().map(|q| (q & 0x0F) as f32 * d + m));
            out.extend(b[4..].iter().map(|q| (q >> 4) as f32 * d + m));
        }
        out
    }

    /// `x` (`[m, cols]`, row-major) times the transpose of this matrix: `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, m)
    }

    /// [`Self::matmul`] with a chosen kernel (tests compare kernels).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.cols);
        matmul_groups(kernel, self.rows, (x, m), |g| self.group(g))
    }
}

/// `x` (`[m, k]`, `k` a multiple of 32) times the transpose of a matrix of `rows` rows whose groups `group` gives
/// (Q4_1's or Q5_1's), with `kernel`.
pub(super) fn matmul_groups<'w>(
    kernel: Kernel,
    rows: usize,
    (x, m): (&[f32], usize),
    group: impl Fn(usize) -> Q4_1Group<'w> + Sync,
) -> Vec<f32> {
    debug_assert_eq!(x.len().checked_div(m).unwrap_or(0) % QK8_1, 0);
    super::matmul_q8_rows(rows, (x, m), kernel.reads_splat_scales(), |g, rows, out| {
        kernel.group_dots(group(g), rows, out)
    })
}

impl Repacked for Q4_1Matrix {
    const DTYPE: GgmlDType = GgmlDType::Q4_1;

    fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        super::block_count(Self::DTYPE, data, (rows, cols))?;
        let nb = cols / QK4_1;
        let slots = rows.div_ceil(GROUP_ROWS) * nb * GROUP_ROWS;
        let mut w = Self {
            d: vec![f16::ZERO; slots],
            m: vec![f16::ZERO; slots],
            qs: super::WeightBytes::zeroed(slots * QK4_1 / 2),
            rows,
            cols,
        };
        for (i, b) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let (at, k) = interleaved(i / nb, i % nb, nb);
            w.d[at * GROUP_ROWS + k] = f16::from_le_bytes([b[0], b[1]]);
            w.m[at * GROUP_ROWS + k] = f16::from_le_bytes([b[2], b[3]]);
            put_nibbles(&mut w.qs, (at, k), &b[4..]);
        }
        Ok(w)
    }

    fn to_bytes(&self) -> Vec<u8> {
        let nb = self.cols / QK4_1;
        let mut out = Vec::with_capacity(self.rows * nb * BLOCK_BYTES);
        for row in 0..self.rows {
            for block in 0..nb {
                let (at, k) = interleaved(row, block, nb);
                out.extend(self.d[at * GROUP_ROWS + k].to_le_bytes());
                out.extend(self.m[at * GROUP_ROWS + k].to_le_bytes());
                out.extend(nibbles(&self.qs, (at, k)));
            }
        }
        out
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }
}

matmul_op!(Q4_1Matrix, "petal-q4_1-matmul");

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    use super::super::test_matrix as random;

    fn q4_1(rows: usize, cols: usize) -> (QTensor, Q4_1Matrix) {
        let q = QTensor::quantize(&random(rows, cols, 7), GgmlDType::Q4_1).unwrap();
        let m = Q4_1Matrix::from_qtensor(&q).unwrap().unwrap();
        (q, m)
    }

    #[test]
    fn dequantizes_bit_for_bit_like_candle() {
        let (q, m) = q4_1(37, 96);
        super::super::assert_dequantizes_like_candle(&q, &m.dequantize());
    }

    #[test]
    fn every_kernel_equals_candle_bit_for_bit() {
        // 37 weight rows: two full groups and a partial one; activation rows around the 4-row, 8-row, 16-row and
        // 64-row tiles, with every remainder of an 8-row tile from 1 to 7 among them, and 16-row tiles followed by
        // tiles of eight and fewer; rows of one and two blocks too (shorter than the tile kernel's pipeline).
        super::super::assert_every_kernel_equals_candle(
            &Kernel::available(),
            (
                &[416, 32, 64],
                &[1, 2, 3, 4, 5, 6, 8, 11, 15, 16, 25, 40, 67],
            ),
            7,
            Q4_1Matrix::matmul_with,
        );
    }

    #[test]
    fn repacking_keeps_the_ggml_bytes_and_stacks_rows_exactly() {
        let (q, a) = q4_1(37, 96);
        let (_, b) = q4_1(5, 96);
        super::super::assert_repacks_and_stacks((&q, &a), &b, Q4_1Matrix::matmul);
    }

    #[test]
    fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_widths() {
        let (_, m) = q4_1(16, 64);
        super::super::assert_op_shapes(&m, 16, 64);
        assert!(Q4_1Matrix::from_bytes(&[0; 19], 1, 32).is_err());
    }
}

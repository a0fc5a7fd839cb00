//! Q4_0 weights repacked at load time into groups of [`GROUP_ROWS`] interleaved rows, multiplied by f32
//! activations with our own kernels ([`kernels`]). Candle's Q4_0 product is one weight row at a time (its AVX2
//! `vec_dot_q4_0_q8_0`), untiled: each activation row of a prefill reads every weight again.
//!
//! The nibbles are laid out as Q4_1's ([`super::q4_1`]: four parts, each four bytes of every row of the group,
//! row `k` at `4k`; a byte's low nibble is value `4p + t`, its high nibble value `4p + t + 16`), the scales by
//! block, the group's rows side by side: eighteen bytes a block, as in the file.
//!
//! The activations are candle's Q8_0 blocks ([`Q8_0Rows`]), and the products are summed in candle's order, the
//! one our Q8_0 blocks' kernels keep ([`super::q8_0`]): eight lanes per row, each the exact sum of four values'
//! products, each block adding `d_w * d_x * lane` to its lane (fused), the lanes summed pairwise at the end. Its
//! output is what the next matmul requantizes, so any other rounding would move a model's logits.
mod kernels;

pub use kernels::Kernel;

use super::q8_0::Q8_0Rows;
use super::{interleaved, nibbles, put_nibbles, Repacked, GROUP_ROWS, NIBBLE_BLOCK_QS};
use crate::error::Result;
use candle_core::quantized::GgmlDType;
use half::f16;

/// Values per block.
pub const QK4_0: usize = 32;
/// Bytes of one ggml `block_q4_0`: scale `d` (a half), 16 bytes of nibbles (`value = d * (q - 8)`).
const BLOCK_BYTES: usize = 18;
/// Nibble bytes of one block of a group.
pub const BLOCK_QS: usize = NIBBLE_BLOCK_QS;

/// A `[rows, cols]` Q4_0 matrix (`cols` a multiple of 32), as `y = x W^T`'s `W`.
#[derive(Debug)]
pub struct Q4_0Matrix {
    /// `[group][block][row of the group]`.
    d: Vec<f16>,
    /// `[group][block][part][row of the group][byte]`.
    qs: super::WeightBytes<u8>,
    rows: usize,
    cols: usize,
}

/// One group's blocks: `d` holds `GROUP_ROWS` halves per block, `qs` [`BLOCK_QS`] bytes.
#[derive(Debug, Clone, Copy)]
pub struct Q4_0Group<'a> {
    pub d: &'a [f16],
    pub qs: &'a [u8],
}

impl Q4_0Group<'_> {
    pub fn blocks(&self) -> usize {
        self.d.len() / GROUP_ROWS
    }
}

impl Q4_0Matrix {
    fn group(&self, g: usize) -> Q4_0Group<'_> {
        let per_group = self.cols / QK4_0 * GROUP_ROWS;
        Q4_0Group {
            d: &self.d[g * per_group..(g + 1) * per_group],
            qs: &self.qs[g * per_group * QK4_0 / 2..(g + 1) * per_group * QK4_0 / 2],
        }
    }

    /// The matrix as f32, row-major: ggml's `dequantize_row_q4_0`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for b in self.to_bytes().chunks_exact(BLOCK_BYTES) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            out.extend(b[2..].iter().map(|q| ((q & 0x0F) as i32 - 8) as f32 * d));
            out.extend(b[2..].iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
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
        let xq = Q8_0Rows::quantize(x, m);
        let rows: Vec<_> = (0..m).map(|i| xq.row(i)).collect();
        super::matmul_by_groups(self.rows, m, |g, tile, out| {
            kernels::group_dots(kernel, self.group(g), &rows[tile], out)
        })
    }
}

impl Repacked for Q4_0Matrix {
    const DTYPE: GgmlDType = GgmlDType::Q4_0;

    fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        super::block_count(Self::DTYPE, data, (rows, cols))?;
        let nb = cols / QK4_0;
        let slots = rows.div_ceil(GROUP_ROWS) * nb;
        let mut w = Self {
            d: vec![f16::ZERO; slots * GROUP_ROWS],
            qs: super::WeightBytes::zeroed(slots * BLOCK_QS),
            rows,
            cols,
        };
        for (i, b) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let (at, k) = interleaved(i / nb, i % nb, nb);
            w.d[at * GROUP_ROWS + k] = f16::from_le_bytes([b[0], b[1]]);
            put_nibbles(&mut w.qs, (at, k), &b[2..]);
        }
        Ok(w)
    }

    fn to_bytes(&self) -> Vec<u8> {
        let nb = self.cols / QK4_0;
        let mut out = Vec::with_capacity(self.rows * nb * BLOCK_BYTES);
        for row in 0..self.rows {
            for block in 0..nb {
                let (at, k) = interleaved(row, block, nb);
                out.extend(self.d[at * GROUP_ROWS + k].to_le_bytes());
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

matmul_op!(Q4_0Matrix, "petal-q4_0-matmul");

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    use super::super::test_matrix as random;

    fn q4_0(rows: usize, cols: usize) -> (QTensor, Q4_0Matrix) {
        let q = QTensor::quantize(&random(rows, cols, 11), GgmlDType::Q4_0).unwrap();
        let m = Q4_0Matrix::from_qtensor(&q).unwrap().unwrap();
        (q, m)
    }

    #[test]
    fn dequantizes_bit_for_bit_like_candle() {
        let (q, m) = q4_0(37, 96);
        super::super::assert_dequantizes_like_candle(&q, &m.dequantize());
    }

    #[test]
    fn every_kernel_equals_candle_bit_for_bit() {
        // 37 weight rows: two full groups and a partial one; activation rows around the kernels' tiles of two and
        // their remainders; rows of one, two and eighteen blocks (SmolLM2's 576).
        super::super::assert_every_kernel_equals_candle(
            &Kernel::available(),
            (&[576, 32, 64], &[1, 2, 3, 4, 5, 16, 17, 67]),
            11,
            Q4_0Matrix::matmul_with,
        );
    }

    #[test]
    fn weights_at_both_ends_of_the_range_equal_candle() {
        // Every weight 0 or 15 (values -8 and 7), the ends of what the unsigned offset and the signs must carry,
        // against activations of both signs.
        let (rows, cols) = (21, 64);
        let mut data = vec![];
        for row in 0..rows {
            for block in 0..cols / QK4_0 {
                data.extend(f16::from_f32(0.5 + row as f32 / 8.0).to_le_bytes());
                data.extend((0..16).map(|i| [0x0F, 0xF0, 0x00, 0xFF][(row + block + i) % 4]));
            }
        }
        super::super::assert_blocks_equal_candle(
            (&data, rows, cols),
            &random(3, cols, 13),
            &Kernel::available(),
            Q4_0Matrix::matmul_with,
        );
    }

    #[test]
    fn repacking_keeps_the_ggml_bytes_and_stacks_rows_exactly() {
        let (q, a) = q4_0(37, 96);
        let (_, b) = q4_0(5, 96);
        super::super::assert_repacks_and_stacks((&q, &a), &b, Q4_0Matrix::matmul);
    }

    #[test]
    fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_widths() {
        let (_, m) = q4_0(16, 64);
        super::super::assert_op_shapes(&m, 16, 64);
        assert!(Q4_0Matrix::from_bytes(&[0; 17], 1, 32).is_err());
    }
}

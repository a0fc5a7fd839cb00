//! Q5_0 weights repacked at load time into groups of [`GROUP_ROWS`] interleaved rows, multiplied by f32
//! activations with our own kernels ([`kernels`]). Candle has no vectorised Q5_0 product (its generic scalar loop,
//! one weight row at a time), yet Q5_0 is most of what llama.cpp's `Q4_K_M` holds for models whose width is not
//! a multiple of 256 (SmolLM2's 576: 166 of its 210 matrices).
//!
//! A block's low four bits are laid out as Q4_1's are ([`super::q4_1`]: four parts, each four bytes of every row
//! of the group, row `k` at `4k`). Its fifth bits are regrouped the same way, as one 64-bit mask per part
//! ([`super::fifth_bits`]), so a masked add puts every row's fifth bits in place at once. Twenty-two bytes a block,
//! as in the file.
mod kernels;

pub use kernels::Kernel;

use super::fifth_bits::BLOCK_MASKS;
use super::q8_1::QK8_1;
use super::{
    fifth_bits, interleaved, nibbles, put_nibbles, Repacked, GROUP_ROWS, NIBBLE_BLOCK_QS,
    PART_BYTES,
};
use crate::error::Result;
use candle_core::quantized::GgmlDType;
use half::f16;

/// Values per block.
pub const QK5_0: usize = 32;
/// Bytes of one ggml `block_q5_0`: scale `d` (a half), the fifth bits `qh` (32, little-endian), 16 bytes of
/// nibbles (`value = d * (q - 16)`).
const BLOCK_BYTES: usize = 22;
/// Nibble bytes of one block of a group.
pub const BLOCK_QS: usize = NIBBLE_BLOCK_QS;

/// A `[rows, cols]` Q5_0 matrix (`cols` a multiple of 32), as `y = x W^T`'s `W`.
#[derive(Debug)]
pub struct Q5_0Matrix {
    /// `[group][block][row of the group]`.
    d: Vec<f16>,
    /// `[group][block][part][row of the group][byte]`.
    qs: super::WeightBytes<u8>,
    /// `[group][block][part]`.
    high: Vec<u64>,
    rows: usize,
    cols: usize,
}

/// One group's blocks: `d` holds `GROUP_ROWS` halves per block, `qs` [`BLOCK_QS`] bytes, `high` [`BLOCK_MASKS`]
/// masks.
#[derive(Debug, Clone, Copy)]
pub struct Q5_0Group<'a> {
    pub d: &'a [f16],
    pub qs: &'a [u8],
    pub high: &'a [u64],
}

impl Q5_0Group<'_> {
    pub fn blocks(&self) -> usize {
        self.d.len() / GROUP_ROWS
    }
}

impl Q5_0Matrix {
    fn group(&self, g: usize) -> Q5_0Group<'_> {
        let blocks = self.cols / QK5_0;
        let i = g * blocks..(g + 1) * blocks;
        Q5_0Group {
            d: &self.d[i.start * GROUP_ROWS..i.end * GROUP_ROWS],
            qs: &self.qs[i.start * BLOCK_QS..i.end * BLOCK_QS],
            high: &self.high[i.start * BLOCK_MASKS..i.end * BLOCK_MASKS],
        }
    }

    /// The matrix as f32, row-major: ggml's `dequantize_row_q5_0`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for b in self.to_bytes().chunks_exact(BLOCK_BYTES) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let value =
                |q: u8, j: usize| ((q as u32 | ((qh >> j) & 1) << 4) as i32 - 16) as f32 * d;
            out.extend(b[6..].iter().enumerate().map(|(j, q)| value(q & 0x0F, j)));
            out.extend(
                b[6..]
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
        debug_assert_eq!(x.len(), m * self.cols);
        debug_assert_eq!(self.cols % QK8_1, 0);
        // Candle quantizes the activations to Q8_0 for this product; Q8_1's scales and bytes are the same values.
        super::matmul_q8_rows(self.rows, (x, m), false, |g, rows, out| {
            kernels::group_dots(kernel, self.group(g), rows, out)
        })
    }
}

impl Repacked for Q5_0Matrix {
    const DTYPE: GgmlDType = GgmlDType::Q5_0;

    fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        super::block_count(Self::DTYPE, data, (rows, cols))?;
        let nb = cols / QK5_0;
        let slots = rows.div_ceil(GROUP_ROWS) * nb;
        let mut w = Self {
            d: vec![f16::ZERO; slots * GROUP_ROWS],
            qs: super::WeightBytes::zeroed(slots * BLOCK_QS),
            high: vec![0; slots * BLOCK_MASKS],
            rows,
            cols,
        };
        for (i, b) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let (at, k) = interleaved(i / nb, i % nb, nb);
            w.d[at * GROUP_ROWS + k] = f16::from_le_bytes([b[0], b[1]]);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            fifth_bits::put(&mut w.high, (at, k), qh);
            put_nibbles(&mut w.qs, (at, k), &b[6..]);
        }
        Ok(w)
    }

    fn to_bytes(&self) -> Vec<u8> {
        let nb = self.cols / QK5_0;
        let mut out = Vec::with_capacity(self.rows * nb * BLOCK_BYTES);
        for row in 0..self.rows {
            for block in 0..nb {
                let (at, k) = interleaved(row, block, nb);
                out.extend(self.d[at * GROUP_ROWS + k].to_le_bytes());
                out.extend(fifth_bits::get(&self.high, (at, k)).to_le_bytes());
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

matmul_op!(Q5_0Matrix, "petal-q5_0-matmul");

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    use super::super::test_matrix as random;

    fn q5_0(rows: usize, cols: usize) -> (QTensor, Q5_0Matrix) {
        let q = QTensor::quantize(&random(rows, cols, 7), GgmlDType::Q5_0).unwrap();
        let m = Q5_0Matrix::from_qtensor(&q).unwrap().unwrap();
        (q, m)
    }

    #[test]
    fn dequantizes_bit_for_bit_like_candle() {
        let (q, m) = q5_0(37, 96);
        super::super::assert_dequantizes_like_candle(&q, &m.dequantize());
    }

    #[test]
    fn every_kernel_equals_candle_bit_for_bit() {
        // 37 weight rows: two full groups and a partial one; activation rows around the 8-row and 16-row tiles,
        // with every remainder of an 8-row tile among them, and more than one 64-row tile of the matmul. Widths of
        // an even number of blocks (candle's Q5_0 product asserts it in debug builds), from two blocks up.
        super::super::assert_every_kernel_equals_candle(
            &Kernel::available(),
            (
                &[448, 64, 128],
                &[1, 2, 3, 4, 5, 6, 7, 8, 11, 15, 16, 17, 25, 40, 67],
            ),
            7,
            Q5_0Matrix::matmul_with,
        );
    }

    #[test]
    fn every_fifth_bit_reaches_its_value() {
        // One weight row per fifth bit set alone (and a row of all of them), so a bit that went to the wrong part
        // or lane would change one output.
        let cols = 64;
        let mut data = vec![];
        for row in 0..33 {
            for block in 0..cols / QK5_0 {
                data.extend(f16::from_f32(0.5 + block as f32).to_le_bytes());
                let qh: u32 = match row {
                    32 => u32::MAX,
                    j => 1 << j,
                };
                data.extend(qh.to_le_bytes());
                data.extend((0..16u8).map(|i| i.wrapping_mul(7).wrapping_add(row as u8)));
            }
        }
        super::super::assert_blocks_equal_candle(
            (&data, 33, cols),
            &random(3, cols, 11),
            &Kernel::available(),
            Q5_0Matrix::matmul_with,
        );
    }

    #[test]
    fn repacking_keeps_the_ggml_bytes_and_stacks_rows_exactly() {
        let (q, a) = q5_0(37, 128);
        let (_, b) = q5_0(5, 128);
        super::super::assert_repacks_and_stacks((&q, &a), &b, Q5_0Matrix::matmul);
    }

    #[test]
    fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_widths() {
        let (_, m) = q5_0(16, 64);
        super::super::assert_op_shapes(&m, 16, 64);
        assert!(Q5_0Matrix::from_bytes(&[0; 21], 1, 32).is_err());
    }
}

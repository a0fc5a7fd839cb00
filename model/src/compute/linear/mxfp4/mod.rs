//! MXFP4 weights (ggml's tensor type 39: gpt-oss's expert matrices), repacked at load time into groups of
//! [`GROUP_ROWS`] interleaved rows and multiplied by f32 activations with our own kernels ([`kernels`]). Candle
//! 0.11.1 has no MXFP4 at all (no `GgmlDType`, no kernel), so this matrix is built from raw bytes: a GGUF
//! tensor's ggml blocks ([`Mxfp4Matrix::from_ggml_bytes`]) or a Hugging Face checkpoint's `*_blocks` and
//! `*_scales` ([`Mxfp4Matrix::from_hf_blocks`]).
//!
//! A ggml block is 32 values in 17 bytes: an E8M0 exponent `e`, then 16 bytes whose byte `j` holds value `j` in
//! its low nibble and value `j + 16` in its high one, each nibble an index into [`KVALUES`] (FP4 E2M1 values
//! doubled, so they are integers) and the value `KVALUES[q] * 2^(e - 127) / 2`. Hugging Face stores the same
//! numbers (the FP4 values themselves, times `2^(e - 127)`) with another nibble order: byte `k` holds values `2k`
//! (low) and `2k + 1` (high). Repacked, both are ggml's order, laid out as Q4_0's nibbles ([`super::q4_0`]: four
//! parts, each four bytes of every row of the group), the exponents one byte per block and row.
//!
//! The activations are candle's Q8_0 blocks ([`Q8_0Rows`]), and the products are summed in the order of ggml's
//! AVX2 `ggml_vec_dot_mxfp4_q8_0` ([`kernels`]), so a model's outputs are those of llama.cpp's CPU backend on most
//! x86 machines, up to how the activations were quantized.
mod kernels;

pub use kernels::Kernel;

use super::q8_0::Q8_0Rows;
use super::{interleaved, nibbles, put_nibbles, GROUP_ROWS, NIBBLE_BLOCK_QS};
use crate::error::{ModelError, Result};

/// Values per block.
pub const QK_MXFP4: usize = 32;
/// Bytes of one ggml `block_mxfp4`: the exponent `e`, then 16 bytes of nibbles.
pub const BLOCK_BYTES: usize = 1 + QK_MXFP4 / 2;
/// Nibble bytes of one block of a group.
pub const BLOCK_QS: usize = NIBBLE_BLOCK_QS;
/// ggml's `kvalues_mxfp4`: the FP4 E2M1 values (`0, 0.5, 1, 1.5, 2, 3, 4, 6`, then negated) doubled, so a block's
/// products with Q8_0 activations are integers; [`e8m0_half`] halves the scale to make up for it.
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The scale of a block of exponent `e` applied to [`KVALUES`]: `2^(e - 127) / 2`, ggml's
/// `GGML_E8M0_TO_FP32_HALF`. Exact for every `e`: `2^-128` and `2^-127` (`e` 0 and 1) are subnormal floats, built
/// from their bits as ggml does. `e = 255`, NaN in the OCP format, is `2^127`, as in ggml.
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// A `[rows, cols]` MXFP4 matrix (`cols` a multiple of 32), as `y = x W^T`'s `W`.
#[derive(Debug)]
pub struct Mxfp4Matrix {
    /// `[group][block][row of the group]`: each block's E8M0 exponent.
    e: Vec<u8>,
    /// `[group][block][part][row of the group][byte]`.
    qs: super::WeightBytes<u8>,
    rows: usize,
    cols: usize,
}

/// One group's blocks: `e` holds `GROUP_ROWS` exponents per block, `qs` [`BLOCK_QS`] bytes.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Group<'a> {
    pub e: &'a [u8],
    pub qs: &'a [u8],
}

impl Mxfp4Group<'_> {
    pub fn blocks(&self) -> usize {
        self.e.len() / GROUP_ROWS
    }
}

/// The blocks of a `[rows, cols]` matrix, or why `cols` cannot be one (not a whole number of blocks, or a size
/// that overflows).
fn block_count(rows: usize, cols: usize) -> Result<usize> {
    if cols == 0 || !cols.is_multiple_of(QK_MXFP4) {
        return Err(ModelError::Config(format!(
            "an MXFP4 matrix's rows must be a positive multiple of {QK_MXFP4} values, not {cols}"
        )));
    }
    rows.checked_mul(cols / QK_MXFP4)
        .filter(|n| n.checked_mul(BLOCK_BYTES).is_some())
        .ok_or_else(|| ModelError::Config(format!("a [{rows}, {cols}] MXFP4 matrix is too large")))
}

/// `data` is `want` bytes, or an error naming what it holds and what it was to be.
fn check_len(what: &str, data: &[u8], want: usize, (rows, cols): (usize, usize)) -> Result<()> {
    if data.len() != want {
        return Err(ModelError::Config(format!(
            "{} bytes of MXFP4 {what} for a [{rows}, {cols}] matrix, which takes {want}",
            data.len()
        )));
    }
    Ok(())
}

impl Mxfp4Matrix {
    /// Repacks raw ggml `block_mxfp4`s (row by row, as a GGUF tensor of type 39 holds them) into interleaved
    /// groups.
    pub fn from_ggml_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let n = block_count(rows, cols)?;
        check_len("blocks", data, n * BLOCK_BYTES, (rows, cols))?;
        let mut w = Self::zeroed(rows, cols);
        let nb = cols / QK_MXFP4;
        for (i, b) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            w.put((i / nb, i % nb), b[0], &b[1..]);
        }
        Ok(w)
    }

    /// Repacks a Hugging Face checkpoint's MXFP4 matrix: `blocks` as its `*_blocks` tensor (`[rows, cols / 32,
    /// 16]` bytes, byte `k` of a block holding value `2k` in its low nibble and `2k + 1` in its high one) and
    /// `scales` as its `*_scales` (`[rows, cols / 32]` exponents). A checkpoint's tensors carry a leading experts
    /// dimension: pass one expert's slices.
    pub fn from_hf_blocks(blocks: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let n = block_count(rows, cols)?;
        check_len("blocks", blocks, n * (QK_MXFP4 / 2), (rows, cols))?;
        check_len("scales", scales, n, (rows, cols))?;
        let mut w = Self::zeroed(rows, cols);
        let nb = cols / QK_MXFP4;
        for (i, (hf, &e)) in blocks.chunks_exact(QK_MXFP4 / 2).zip(scales).enumerate() {
            // Value `v`'s nibble: the low one of byte `v / 2` for even `v`, the high one for odd.
            let q = |v: usize| (hf[v / 2] >> (4 * (v % 2))) & 0x0F;
            let ggml: [u8; QK_MXFP4 / 2] = std::array::from_fn(|j| q(j) | (q(j + 16) << 4));
            w.put((i / nb, i % nb), e, &ggml);
        }
        Ok(w)
    }

    /// Expert `expert` of a checkpoint's stacked `*_blocks` and `*_scales` (`experts` matrices of `[rows, cols]`,
    /// back to back), or with `half`, only its rows `half, half + 2, ..` (gpt-oss interleaves gate and up by row).
    pub fn from_hf_stack(
        blocks: &[u8],
        scales: &[u8],
        (experts, rows, cols): (usize, usize, usize),
        expert: usize,
        half: Option<usize>,
    ) -> Result<Self> {
        let n = block_count(rows, cols)?;
        let stack = (experts * rows, cols);
        check_len("blocks", blocks, experts * n * (QK_MXFP4 / 2), stack)?;
        check_len("scales", scales, experts * n, stack)?;
        if expert >= experts || half.is_some_and(|h| h > 1 || !rows.is_multiple_of(2)) {
            return Err(ModelError::Config(format!(
                "no expert {expert} (half {half:?}) in {experts} MXFP4 matrices of {rows} rows"
            )));
        }
        let pick = |data: &[u8], per_row: usize| -> Vec<u8> {
            let all =
                data[expert * rows * per_row..(expert + 1) * rows * per_row].chunks_exact(per_row);
            match half {
                None => all.flatten().copied().collect(),
                Some(h) => all.skip(h).step_by(2).flatten().copied().collect(),
            }
        };
        let nb = cols / QK_MXFP4;
        let rows = if half.is_some() { rows / 2 } else { rows };
        Self::from_hf_blocks(
            &pick(blocks, nb * QK_MXFP4 / 2),
            &pick(scales, nb),
            rows,
            cols,
        )
    }

    /// The matrix as a Hugging Face checkpoint stores it: `(blocks, scales)` as [`Self::from_hf_blocks`] takes
    /// them.
    pub fn to_hf_blocks(&self) -> (Vec<u8>, Vec<u8>) {
        let n = self.rows * (self.cols / QK_MXFP4);
        let (mut blocks, mut scales) =
            (Vec::with_capacity(n * QK_MXFP4 / 2), Vec::with_capacity(n));
        for b in self.to_bytes().chunks_exact(BLOCK_BYTES) {
            scales.push(b[0]);
            // ggml's byte `j` holds value `j` low and `j + 16` high.
            let q = |v: usize| (b[1 + v % 16] >> (4 * (v / 16))) & 0x0F;
            blocks.extend((0..QK_MXFP4 / 2).map(|k| q(2 * k) | (q(2 * k + 1) << 4)));
        }
        (blocks, scales)
    }

    /// A matrix of zero exponents and nibbles, its groups' rows past `rows` included.
    fn zeroed(rows: usize, cols: usize) -> Self {
        let slots = rows.div_ceil(GROUP_ROWS) * (cols / QK_MXFP4);
        Self {
            e: vec![0; slots * GROUP_ROWS],
            qs: super::WeightBytes::zeroed(slots * BLOCK_QS),
            rows,
            cols,
        }
    }

    /// Writes block `block` of row `row`: its exponent and its sixteen nibble bytes in ggml's order.
    fn put(&mut self, (row, block): (usize, usize), e: u8, qs: &[u8]) {
        let (at, k) = interleaved(row, block, self.cols / QK_MXFP4);
        self.e[at * GROUP_ROWS + k] = e;
        put_nibbles(&mut self.qs, (at, k), qs);
    }

    /// The matrix as ggml's row-by-row blocks again: the bytes [`Self::from_ggml_bytes`] took.
    pub fn to_bytes(&self) -> Vec<u8> {
        let nb = self.cols / QK_MXFP4;
        let mut out = Vec::with_capacity(self.rows * nb * BLOCK_BYTES);
        for row in 0..self.rows {
            for block in 0..nb {
                let (at, k) = interleaved(row, block, nb);
                out.push(self.e[at * GROUP_ROWS + k]);
                out.extend(nibbles(&self.qs, (at, k)));
            }
        }
        out
    }

    /// The rows of several matrices of the same width, one after another (as [`super::Repacked::concat_rows`]
    /// does for the ggml formats candle knows): one matmul instead of several over the same input.
    pub fn concat_rows(parts: &[&Self]) -> Result<Self> {
        let cols = parts.first().map(|p| p.cols).unwrap_or(QK_MXFP4);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(ModelError::Config(
                "MXFP4 matrices of different widths cannot be stacked".into(),
            ));
        }
        let bytes: Vec<u8> = parts.iter().flat_map(|p| p.to_bytes()).collect();
        Self::from_ggml_bytes(&bytes, parts.iter().map(|p| p.rows).sum(), cols)
    }

    /// The matrix as f32, row-major: ggml's `dequantize_row_mxfp4`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for b in self.to_bytes().chunks_exact(BLOCK_BYTES) {
            let d = e8m0_half(b[0]);
            out.extend(
                b[1..]
                    .iter()
                    .map(|q| KVALUES[usize::from(q & 0x0F)] as f32 * d),
            );
            out.extend(
                b[1..]
                    .iter()
                    .map(|q| KVALUES[usize::from(q >> 4)] as f32 * d),
            );
        }
        out
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn group(&self, g: usize) -> Mxfp4Group<'_> {
        let per_group = self.cols / QK_MXFP4 * GROUP_ROWS;
        Mxfp4Group {
            e: &self.e[g * per_group..(g + 1) * per_group],
            qs: &self.qs[g * per_group * QK_MXFP4 / 2..(g + 1) * per_group * QK_MXFP4 / 2],
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
        let rows: Vec<_> = (0..m).map(|i| xq.row(i)).collect();
        super::matmul_by_groups(self.rows, m, |g, tile, out| {
            kernels::group_dots(kernel, self.group(g), &rows[tile], out)
        })
    }
}

/// `values` (rows of `cols` values each, row-major) as ggml's MXFP4 blocks, as ggml's `quantize_row_mxfp4_ref`
/// writes them: each block's exponent from its largest magnitude `amax` (`floor(log2(amax)) - 2 + 127`, so that
/// `amax` falls at 8 or above of the [`KVALUES`] scale, clamped to `0..=255`; 0 for a block of zeros), then each
/// value's nearest of the scaled [`KVALUES`], the first in table order on a tie. What the tests and the synthetic
/// model writer make MXFP4 tensors with: values exactly representable in a block come back exactly.
///
/// # Panics
/// If `cols` is not a positive multiple of 32 or `values` not a whole number of rows (the caller's shapes, not a
/// file's).
pub fn quantize_ggml(values: &[f32], cols: usize) -> Vec<u8> {
    assert!(
        cols > 0 && cols.is_multiple_of(QK_MXFP4) && values.len().is_multiple_of(cols),
        "MXFP4 rows of {cols} values cannot hold {} values",
        values.len()
    );
    let mut out = Vec::with_capacity(values.len() / QK_MXFP4 * BLOCK_BYTES);
    for x in values.chunks_exact(QK_MXFP4) {
        // ggml's `amax < fabsf(v)` skips NaNs.
        let amax = x
            .iter()
            .fold(0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        // `as u8` saturates: ggml's `(uint8_t)` cast of the same float, clamped where C's is undefined.
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_half(e);
        out.push(e);
        out.extend((0..QK_MXFP4 / 2).map(|j| nearest(x[j], d) | (nearest(x[j + 16], d) << 4)));
    }
    out
}

/// ggml's `best_index_mxfp4`: the index of the [`KVALUES`] entry nearest `x` once scaled by `d`, the first on a
/// tie (an error compared, not `x / d`, as ggml does).
fn nearest(x: f32, d: f32) -> u8 {
    let mut best = (0, (KVALUES[0] as f32 * d - x).abs());
    for (i, &k) in KVALUES.iter().enumerate().skip(1) {
        let err = (k as f32 * d - x).abs();
        if err < best.1 {
            best = (i as u8, err);
        }
    }
    best.0
}

matmul_op!(Mxfp4Matrix, "petal-mxfp4-matmul");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::linear::Linear;
    use candle_core::{Device, Tensor};
    use std::sync::Arc;

    /// `2^(e - 128)` by another road than [`e8m0_half`]'s bits.
    fn scale(e: u8) -> f32 {
        2f64.powi(i32::from(e) - 128) as f32
    }

    /// Reproducible bytes: ggml blocks of every nibble, with exponents drawn from `exponents`.
    fn random_blocks(rows: usize, cols: usize, seed: u64, exponents: &[u8]) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as usize
        };
        let mut data = Vec::with_capacity(rows * cols / QK_MXFP4 * BLOCK_BYTES);
        for _ in 0..rows * cols / QK_MXFP4 {
            data.push(exponents[next() % exponents.len()]);
            data.extend((0..QK_MXFP4 / 2).map(|_| next() as u8));
        }
        data
    }

    #[test]
    fn the_scale_is_two_to_the_exponent_less_128_everywhere() {
        assert_eq!(e8m0_half(0), 2f32.powi(-126) / 4.0);
        for e in 0..=255u8 {
            assert_eq!(e8m0_half(e), scale(e), "e = {e}");
        }
    }

    #[test]
    fn hand_built_blocks_dequantize_as_the_formula_says() {
        // Every exponent class (subnormal, around 1, the largest) and every nibble in both halves of a byte.
        let (rows, cols) = (3, 64);
        let exponents = [0u8, 1, 2, 120, 127, 128, 200, 254, 255];
        let mut data = vec![];
        for i in 0..rows * cols / QK_MXFP4 {
            data.push(exponents[i % exponents.len()]);
            data.extend((0..16u8).map(|j| ((j + i as u8) % 16) | ((15 - j) << 4)));
        }
        let m = Mxfp4Matrix::from_ggml_bytes(&data, rows, cols).unwrap();
        assert_eq!((m.rows(), m.cols()), (rows, cols));
        assert_eq!(m.to_bytes(), data);
        let got = m.dequantize();
        for (i, b) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            for j in 0..16 {
                let (lo, hi) = (b[1 + j] & 0x0F, b[1 + j] >> 4);
                let value = |q: u8| KVALUES[q as usize] as f32 * scale(b[0]);
                assert_eq!(
                    got[i * 32 + j].to_bits(),
                    value(lo).to_bits(),
                    "block {i}, {j}"
                );
                assert_eq!(
                    got[i * 32 + j + 16].to_bits(),
                    value(hi).to_bits(),
                    "block {i}, {j}"
                );
            }
        }
        // Spot values: e = 128 is a scale of one, nibble 7 is 12 and nibble 13 is -6.
        let one =
            Mxfp4Matrix::from_ggml_bytes(&[&[128u8, 0xD7][..], &[0; 15]].concat(), 1, 32).unwrap();
        let v = one.dequantize();
        assert_eq!((v[0], v[16], v[1]), (12.0, -6.0, 0.0));
    }

    #[test]
    fn hugging_face_blocks_are_the_same_numbers_in_another_nibble_order() {
        let (rows, cols) = (37, 96);
        let ggml = random_blocks(rows, cols, 3, &[0, 1, 100, 126, 127, 128, 131, 254]);
        // The same values as Hugging Face stores them: byte k holds values 2k (low) and 2k + 1 (high).
        let mut blocks = vec![];
        let mut scales = vec![];
        for b in ggml.chunks_exact(BLOCK_BYTES) {
            let q = |v: usize| {
                if v < 16 {
                    b[1 + v] & 0x0F
                } else {
                    b[1 + v - 16] >> 4
                }
            };
            scales.push(b[0]);
            blocks.extend((0..16).map(|k| q(2 * k) | (q(2 * k + 1) << 4)));
        }
        let hf = Mxfp4Matrix::from_hf_blocks(&blocks, &scales, rows, cols).unwrap();
        let ours = Mxfp4Matrix::from_ggml_bytes(&ggml, rows, cols).unwrap();
        assert_eq!(hf.to_bytes(), ggml);
        assert_eq!(hf.dequantize(), ours.dequantize());
        assert_eq!(ours.to_hf_blocks(), (blocks.clone(), scales.clone()));
        // And they are Hugging Face's numbers: its FP4 table times 2^(scale - 127).
        const FP4: [f32; 16] = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        let want: Vec<f32> = blocks
            .chunks_exact(16)
            .zip(&scales)
            .flat_map(|(b, &s)| {
                let f = 2f64.powi(i32::from(s) - 127);
                b.iter().flat_map(move |q| {
                    [q & 0x0F, q >> 4].map(|n| (FP4[n as usize] as f64 * f) as f32)
                })
            })
            .collect();
        // -0 and +0 aside (ggml's table has no negative zero), bit for bit.
        assert_eq!(hf.dequantize(), want);
    }

    #[test]
    fn quantizing_gives_representable_values_back_exactly() {
        // Blocks of representable values whose largest magnitude is 8 or 12 (the exponent the block was made
        // with) or 6 or less (an exponent one lower, every value still representable), across the exponents.
        let mut s = 7u64;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as usize
        };
        for e in [0u8, 1, 2, 3, 64, 120, 127, 128, 129, 200, 250] {
            for top in [6, 7, 14, 15, 5, 13] {
                // Nibble 8 (a second zero) left out, so that the bytes themselves come back when the exponent does.
                let mut codes: Vec<u8> = (0..32)
                    .map(|_| [0u8, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13][next() % 11])
                    .collect();
                codes[next() % 32] = top;
                let qs: Vec<u8> = (0..16).map(|j| codes[j] | (codes[j + 16] << 4)).collect();
                let block = [&[e][..], &qs].concat();
                let values = Mxfp4Matrix::from_ggml_bytes(&block, 1, 32)
                    .unwrap()
                    .dequantize();
                let q = quantize_ggml(&values, 32);
                let again = Mxfp4Matrix::from_ggml_bytes(&q, 1, 32)
                    .unwrap()
                    .dequantize();
                assert_eq!(again, values, "e = {e}, largest nibble {top}");
                if KVALUES[top as usize].abs() >= 8 {
                    assert_eq!(q, block, "e = {e}, largest nibble {top}");
                } else if e > 0 {
                    assert_eq!(q[0], e - 1, "e = {e}, largest nibble {top}");
                }
            }
        }
        // A block of zeros: exponent 0, nibbles 0.
        assert_eq!(quantize_ggml(&[0.0; 64], 32), vec![0; 34]);
    }

    #[test]
    fn quantizing_takes_the_first_of_two_equally_near_values() {
        // 12 sets the exponent to 128 (a scale of one): 5 is as near 4 as 6, -5 as -4 as -6, 10 as 8 as 12.
        let mut x = [0f32; 32];
        x[..8].copy_from_slice(&[12.0, 5.0, -5.0, 0.5, -0.5, 10.0, -10.0, 7.0]);
        x[16] = 20.0 / 2.0 + 3.0; // 13: nearest 12.
        x[17] = 1e-9; // Nearest 0.
        let q = quantize_ggml(&x, 32);
        assert_eq!(q[0], 128);
        let nib = |v: usize| {
            if v < 16 {
                q[1 + v] & 0x0F
            } else {
                q[1 + v - 16] >> 4
            }
        };
        let picked: Vec<i8> = (0..8).map(|v| KVALUES[nib(v) as usize]).collect();
        assert_eq!(picked, [12, 4, -4, 0, 0, 8, -8, 6]);
        assert_eq!((nib(16), nib(17)), (7, 0));
        // The largest magnitude above the table's 12: clipped to it.
        let big = quantize_ggml(&[&[15.9f32][..], &[0.0; 31]].concat(), 32);
        assert_eq!((big[0], big[1] & 0x0F), (128, 7));
    }

    /// The plain product of `w` (dequantized) with `x` as its Q8_0 blocks, in f64, and each output's sum of
    /// magnitudes (what float rounding is measured against).
    fn reference(w: &Mxfp4Matrix, x: &[f32], m: usize) -> Vec<(f64, f64)> {
        let (n, k) = (w.rows(), w.cols());
        let xq = Q8_0Rows::quantize(x, m);
        let xs: Vec<f64> = (0..m)
            .flat_map(|i| {
                let r = xq.row(i);
                (0..k).map(move |j| r.d[j / 32] as f64 * r.qs[j / 32][j % 32] as f64)
            })
            .collect();
        let wd = w.dequantize();
        let mut out = Vec::with_capacity(m * n);
        for i in 0..m {
            for r in 0..n {
                let terms = (0..k).map(|j| wd[r * k + j] as f64 * xs[i * k + j]);
                let (sum, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                out.push((sum, abs));
            }
        }
        out
    }

    #[test]
    fn every_kernel_gives_the_plain_product_and_the_reference_bit_for_bit() {
        let x_of = |m: usize, k: usize| -> Vec<f32> {
            super::super::test_matrix(m, k, 5 + m as u64)
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .unwrap()
        };
        // Rows of 5 and 37 (a partial group, two and a partial), blocks per row odd and even (1, 3, 2, 9).
        for (rows, cols) in [(37, 96), (5, 32), (37, 64), (21, 288)] {
            let data = random_blocks(rows, cols, rows as u64, &[117, 120, 124, 127, 128, 129]);
            let w = Mxfp4Matrix::from_ggml_bytes(&data, rows, cols).unwrap();
            for m in [1, 3, 17, 70] {
                let x = x_of(m, cols);
                let want = reference(&w, &x, m);
                let scalar = w.matmul_with(Kernel::Scalar, &x, m);
                for ((got, (sum, abs)), i) in scalar.iter().zip(&want).zip(0..) {
                    assert!(
                        (*got as f64 - sum).abs() <= 2e-6 * abs + 1e-30,
                        "[{rows}, {cols}], {m} rows, output {i}: {got} against {sum}"
                    );
                }
                for kernel in Kernel::available() {
                    let got = w.matmul_with(kernel, &x, m);
                    assert_eq!(got, scalar, "{kernel:?}, [{rows}, {cols}], {m} rows");
                }
                assert_eq!(w.matmul(&x, m), scalar);
            }
        }
    }

    #[test]
    fn the_largest_weights_against_the_largest_activations_equal_the_reference() {
        // Every weight ±12 (nibbles 7 and 15) against activations at ±127 of their blocks: the most any pair of
        // products can reach in the kernels' 16-bit sums. The subnormal scales too.
        let (rows, cols) = (19, 96);
        let mut data = vec![];
        for i in 0..rows * cols / QK_MXFP4 {
            data.push([0u8, 1, 128, 140][i % 4]);
            data.extend((0..16).map(|j| [0x77, 0xFF, 0x7F, 0xF7][(i + j) % 4]));
        }
        let w = Mxfp4Matrix::from_ggml_bytes(&data, rows, cols).unwrap();
        let x: Vec<f32> = (0..3 * cols)
            .map(|j| if (j / 3) % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let scalar = w.matmul_with(Kernel::Scalar, &x, 3);
        for ((got, (sum, abs)), i) in scalar.iter().zip(reference(&w, &x, 3)).zip(0..) {
            assert!(
                (*got as f64 - sum).abs() <= 2e-6 * abs,
                "output {i}: {got} against {sum}"
            );
        }
        for kernel in Kernel::available() {
            assert_eq!(w.matmul_with(kernel, &x, 3), scalar, "{kernel:?}");
        }
    }

    #[test]
    fn as_a_linear_and_a_tensor_op_it_keeps_leading_dims_and_refuses_wrong_widths() {
        let (rows, cols) = (20, 64);
        let w = Arc::new(
            Mxfp4Matrix::from_ggml_bytes(&random_blocks(rows, cols, 1, &[127]), rows, cols)
                .unwrap(),
        );
        super::super::assert_op_shapes(w.as_ref(), rows, cols);
        let x = super::super::test_matrix(3, cols, 2);
        let linear = Linear::Mxfp4(w.clone());
        assert!(linear.rows_independent());
        let y = linear.forward(&x).unwrap();
        assert_eq!(y.dims(), &[3, rows]);
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            w.matmul(&xs, 3)
        );
        let wrong = Tensor::zeros((3, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(linear.forward(&wrong).is_err());
    }

    #[test]
    fn stacked_rows_give_each_part_its_own_outputs() {
        let a =
            Mxfp4Matrix::from_ggml_bytes(&random_blocks(37, 64, 4, &[126, 128]), 37, 64).unwrap();
        let b = Mxfp4Matrix::from_ggml_bytes(&random_blocks(5, 64, 5, &[127]), 5, 64).unwrap();
        let both = Mxfp4Matrix::concat_rows(&[&a, &b]).unwrap();
        assert_eq!((both.rows(), both.cols()), (42, 64));
        assert_eq!(both.to_bytes(), [a.to_bytes(), b.to_bytes()].concat());
        let narrow = Mxfp4Matrix::from_ggml_bytes(&random_blocks(2, 32, 6, &[127]), 2, 32).unwrap();
        assert!(Mxfp4Matrix::concat_rows(&[&a, &narrow]).is_err());
    }

    #[test]
    fn wrong_byte_counts_and_widths_are_errors() {
        assert!(Mxfp4Matrix::from_ggml_bytes(&[0; 17], 1, 32).is_ok());
        for (len, rows, cols) in [
            (16, 1, 32),
            (18, 1, 32),
            (17, 2, 32),
            (0, 1, 0),
            (17, 1, 16),
            (34, 1, 48),
        ] {
            let err = Mxfp4Matrix::from_ggml_bytes(&vec![0; len], rows, cols).unwrap_err();
            assert!(
                matches!(err, ModelError::Config(_)),
                "{len} bytes, [{rows}, {cols}]: {err}"
            );
        }
        assert!(Mxfp4Matrix::from_ggml_bytes(&[], usize::MAX, 64).is_err());
        assert!(Mxfp4Matrix::from_hf_blocks(&[0; 32], &[0; 2], 2, 32).is_ok());
        assert!(Mxfp4Matrix::from_hf_blocks(&[0; 31], &[0; 2], 2, 32).is_err());
        assert!(Mxfp4Matrix::from_hf_blocks(&[0; 32], &[0; 1], 2, 32).is_err());
        assert!(Mxfp4Matrix::from_hf_blocks(&[0; 32], &[0; 2], 1, 64 + 16).is_err());
    }
}

//! Activations quantized to Q8_1 blocks, the form the Q4_1 dot product takes them in.
//!
//! Bit-for-bit the quantization of ggml's `quantize_row_q8_1` as candle implements it (including the half-precision
//! product for `s`); the scales are kept as the f32 values of those halves, converted once per row instead of once
//! per weight row that meets them.
use half::f16;

/// Values per block.
pub const QK8_1: usize = 32;

/// Rows of activations, each `blocks` blocks of 32 signed bytes with scale `d` and `s = d * sum(qs)`.
#[derive(Debug, Default)]
pub struct Q8Rows {
    pub blocks: usize,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub qs: Vec<[i8; QK8_1]>,
}

/// One row of [`Q8Rows`].
#[derive(Debug, Clone, Copy)]
pub struct Q8Row<'a> {
    pub d: &'a [f32],
    pub s: &'a [f32],
    pub qs: &'a [[i8; QK8_1]],
}

impl Q8Rows {
    /// Quantizes `m` rows of `x` (row-major, a multiple of 32 values per row).
    pub fn quantize(x: &[f32], m: usize) -> Self {
        let blocks = x.len().checked_div(m).unwrap_or(0) / QK8_1;
        let n = m * blocks;
        let mut rows = Self {
            blocks,
            d: vec![0.0; n],
            s: vec![0.0; n],
            qs: vec![[0; QK8_1]; n],
        };
        for (((xs, d), s), qs) in x
            .chunks_exact(QK8_1)
            .zip(&mut rows.d)
            .zip(&mut rows.s)
            .zip(&mut rows.qs)
        {
            (*d, *s) = quantize_block(xs, qs);
        }
        rows
    }

    pub fn row(&self, i: usize) -> Q8Row<'_> {
        let r = i * self.blocks..(i + 1) * self.blocks;
        Q8Row {
            d: &self.d[r.clone()],
            s: &self.s[r.clone()],
            qs: &self.qs[r],
        }
    }
}

/// One block: returns `(d, s)` as the f32 values of their halves.
fn quantize_block(xs: &[f32], qs: &mut [i8; QK8_1]) -> (f32, f32) {
    let amax = xs.iter().fold(0f32, |a, x| a.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let d = f16::from_f32(d);
    let mut sum = 0i32;
    for (q, x) in qs.iter_mut().zip(xs) {
        *q = (x * id).round() as i8;
        sum += *q as i32;
    }
    let s = f16::from_f32(sum as f32) * d;
    (d.to_f32(), s.to_f32())
}

//! Activations quantized to Q8_K super-blocks of 256 values, as candle's `BlockQ8K::from_float` does: what the
//! K-quant weights ([`super::Q4K`], [`super::Q5K`], [`super::Q6K`]) are multiplied by. Beside each block's bytes it keeps the
//! sums the kernels need per block, computed once per activation row rather than once per weight group.

/// Values per super-block.
pub const QK_K: usize = 256;

/// One row's super-blocks.
#[derive(Debug, Clone, Copy)]
pub struct Q8KRow<'a> {
    /// Each block's scale.
    pub d: &'a [f32],
    pub qs: &'a [[i8; QK_K]],
    /// Sums of each pair of 32-value sub-blocks as two halves of a word (`s[2i] | s[2i + 1] << 16`): what Q4_K's
    /// minimums multiply.
    pub sub_sums: &'a [[i32; 4]],
    /// For each four values `4w..4w + 4`, `32 * (y[4w] + y[4w + 1])` and `32 * (y[4w + 2] + y[4w + 3])` as two
    /// halves of a word: what Q6_K's `- 32` takes off a product of its unsigned weights.
    pub offsets: &'a [[i32; QK_K / 4]],
}

/// `m` rows of activations as Q8_K blocks.
#[derive(Debug)]
pub struct Q8KRows {
    blocks: usize,
    d: Vec<f32>,
    qs: Vec<[i8; QK_K]>,
    sub_sums: Vec<[i32; 4]>,
    offsets: Vec<[i32; QK_K / 4]>,
}

/// Two 16-bit values as the halves of one word, the low first (as `madd` reads them).
fn pair(lo: i32, hi: i32) -> i32 {
    (lo as u16 as u32 | (hi as u16 as u32) << 16) as i32
}

impl Q8KRows {
    /// `m` rows of `x` (row-major, a multiple of 256 values each).
    pub fn quantize(x: &[f32], m: usize) -> Self {
        let blocks = x.len().checked_div(m).unwrap_or(0) / QK_K;
        let n = m * blocks;
        let mut q = Self {
            blocks,
            d: Vec::with_capacity(n),
            qs: Vec::with_capacity(n),
            sub_sums: Vec::with_capacity(n),
            offsets: Vec::with_capacity(n),
        };
        for xs in x.chunks_exact(QK_K) {
            let (d, qs) = quantize_block(xs);
            // Candle's `bsums` (sums of 16) added in pairs, as its Q4_K kernel's `hadd` does.
            let sums: [i32; 8] =
                std::array::from_fn(|s| qs[32 * s..32 * s + 32].iter().map(|&v| v as i32).sum());
            q.sub_sums
                .push(std::array::from_fn(|i| pair(sums[2 * i], sums[2 * i + 1])));
            q.offsets.push(std::array::from_fn(|w| {
                let v = |i: usize| qs[4 * w + i] as i32;
                pair(32 * (v(0) + v(1)), 32 * (v(2) + v(3)))
            }));
            q.d.push(d);
            q.qs.push(qs);
        }
        q
    }

    pub fn row(&self, i: usize) -> Q8KRow<'_> {
        let r = i * self.blocks..(i + 1) * self.blocks;
        Q8KRow {
            d: &self.d[r.clone()],
            qs: &self.qs[r.clone()],
            sub_sums: &self.sub_sums[r.clone()],
            offsets: &self.offsets[r],
        }
    }
}

/// Candle's `quantize_row_q8k`: the scale from the value of largest magnitude (its sign kept, so that value is
/// -127), each value rounded half away from zero.
fn quantize_block(xs: &[f32]) -> (f32, [i8; QK_K]) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &x in xs {
        if amax < x.abs() {
            amax = x.abs();
            max = x;
        }
    }
    if amax == 0.0 {
        return (0.0, [0; QK_K]);
    }
    let iscale = -127f32 / max;
    let qs = std::array::from_fn(|j| (iscale * xs[j]).round().clamp(-128.0, 127.0) as i8);
    (1.0 / iscale, qs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};

    #[test]
    fn blocks_equal_candles() {
        let x: Vec<f32> = super::super::super::test_matrix(3, 512, 9)
            .flatten_all()
            .and_then(|t| t.to_vec1())
            .unwrap();
        let ours = Q8KRows::quantize(&x, 3);
        let mut theirs = vec![BlockQ8K::zeros(); 6];
        BlockQ8K::from_float(&x, &mut theirs);
        for (i, b) in theirs.iter().enumerate() {
            let (row, block) = (ours.row(i / 2), i % 2);
            // The fields are candle's own; its dequantization shows them.
            let mut want = [0f32; QK_K];
            BlockQ8K::to_float(std::slice::from_ref(b), &mut want);
            let got: Vec<f32> = row.qs[block]
                .iter()
                .map(|&q| q as f32 * row.d[block])
                .collect();
            assert_eq!(got, want, "block {i}");
        }
        let zeros = Q8KRows::quantize(&[0.0; QK_K], 1);
        assert_eq!((zeros.d[0], zeros.qs[0]), (0.0, [0; QK_K]));
    }

    #[test]
    fn pairs_hold_signed_halves() {
        let w = pair(-3, 5);
        assert_eq!((w as i16, (w >> 16) as i16), (-3, 5));
    }
}

//! The K-quants (Q4_K, Q5_K, Q6_K: what llama.cpp's Q4_K_M and Q5_K_M files hold) in the file's own bytes, repacked at
//! load time into groups of [`GROUP_ROWS`] interleaved rows and multiplied by Q8_K activations ([`q8_k`]) with
//! our kernels. Candle's product expands a Q4_K matrix (and Q6_K at more than one row) into a second, larger copy
//! kept beside the first: an 8B Q4_K_M file peaked at 2.5x its size.
//!
//! A group's super-block is the rows' blocks cut into 32-bit words, each word of every row side by side (row `k`
//! at `4k`, so one 512-bit load gives each row's word in its own lane), after the blocks' half-precision scales
//! side by side: the file's bytes, no more. The kernels sum in the order of candle's AVX2 `vec_dot` (eight lanes
//! per row, each the exact integer sum of values `4l..4l + 4` of every 32-value chunk, one fused multiply-add per
//! super-block), and give its result bit for bit. They give no prefetch hints: each group is read front to back,
//! which the hardware prefetcher follows, and the hints the other kernels use (eight blocks ahead, every line)
//! slowed a 14336 x 4096 Q4_K product from memory by a third.
mod lanes;
mod q4_k;
mod q6_k;
pub mod q8_k;

pub use q4_k::{Q4K, Q5K};
pub use q6_k::Q6K;
pub use q8_k::QK_K;

use super::{Repacked, GROUP_ROWS, PART_BYTES};
use crate::error::Result;
use candle_core::quantized::GgmlDType;
use q8_k::{Q8KRow, Q8KRows};
use std::marker::PhantomData;

/// Where a format's block keeps its half-precision scales and its 32-bit words.
#[derive(Debug, Clone, Copy)]
pub struct BlockLayout {
    /// Bytes of one ggml block of 256 values.
    pub bytes: usize,
    /// Offsets of the halves in the block (Q4_K, Q5_K: `d`, `dmin`; Q6_K: `d`).
    pub halves: &'static [usize],
    /// The block's words: `words` of them from byte `words_at`.
    pub words_at: usize,
    pub words: usize,
    /// Which of the block's words each of the group's words holds (empty: the same one): the order the kernel
    /// reads them in, so that a group is read front to back, as the hardware prefetcher follows best (Q6_K read
    /// in the block's own order touched six places of a super-block at once and ran at half candle's speed).
    pub order: &'static [u8],
}

impl BlockLayout {
    /// Bytes of a group's super-block.
    pub const fn group_bytes(&self) -> usize {
        GROUP_ROWS * self.bytes
    }

    /// Where half `i` of row `k` lives in a group's super-block.
    const fn half_at(&self, i: usize, k: usize) -> usize {
        i * 2 * GROUP_ROWS + 2 * k
    }

    /// Where the group's word `w` (one per row, side by side) starts in its super-block.
    pub const fn word_at(&self, w: usize) -> usize {
        self.halves.len() * 2 * GROUP_ROWS + w * PART_BYTES
    }

    /// Writes one ggml block as row `k` of the group super-block `dst`.
    fn put(&self, dst: &mut [u8], k: usize, block: &[u8]) {
        for (i, &at) in self.halves.iter().enumerate() {
            let to = self.half_at(i, k);
            dst[to..to + 2].copy_from_slice(&block[at..at + 2]);
        }
        for w in 0..self.words {
            let (to, from) = (
                self.word_at(w) + 4 * k,
                self.words_at + 4 * self.block_word(w),
            );
            dst[to..to + 4].copy_from_slice(&block[from..from + 4]);
        }
    }

    /// The block's word that the group's word `w` holds.
    fn block_word(&self, w: usize) -> usize {
        self.order.get(w).map_or(w, |&b| b as usize)
    }

    /// Row `k`'s ggml block again, from the group super-block `src`.
    fn get(&self, src: &[u8], k: usize) -> Vec<u8> {
        let mut block = vec![0; self.bytes];
        for (i, &at) in self.halves.iter().enumerate() {
            let from = self.half_at(i, k);
            block[at..at + 2].copy_from_slice(&src[from..from + 2]);
        }
        for w in 0..self.words {
            let from = self.word_at(w) + 4 * k;
            let to = self.words_at + 4 * self.block_word(w);
            block[to..to + 4].copy_from_slice(&src[from..from + 4]);
        }
        block
    }
}

/// A K-quant format: its layout and its kernels.
pub trait KFormat: Send + Sync + 'static {
    const DTYPE: GgmlDType;
    const LAYOUT: BlockLayout;
    /// The 256 values of one ggml block, as ggml's `dequantize_row`.
    fn dequantize(block: &[u8], out: &mut [f32]);
    /// `out[r][k] = dot(row k of the group, xs[r])`; `group` holds the group's super-blocks one after another.
    fn group_dots(kernel: Kernel, group: &[u8], xs: &[Q8KRow<'_>], out: &mut [[f32; GROUP_ROWS]]);
}

/// The K-quant kernels: a scalar reference, a 256-bit one and a 512-bit one (where there is no vector one, a
/// matrix stays candle's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    /// Every kernel this CPU can run, slowest first.
    pub fn available() -> Vec<Self> {
        let mut all = vec![Self::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = super::cpu_features();
            if cpu.avx2 {
                all.push(Self::Avx2);
            }
            if cpu.avx512_vnni {
                all.push(Self::Avx512);
            }
        }
        all
    }

    /// The fastest vector kernel, if this CPU has one: the scalar one is the tests' reference, slower than candle's.
    pub fn vector() -> Option<Self> {
        Self::available().into_iter().rfind(|k| *k != Self::Scalar)
    }
}

/// A `[rows, cols]` K-quant matrix (`cols` a multiple of 256), as `y = x W^T`'s `W`.
pub struct KMatrix<F: KFormat> {
    /// `[group][super-block]`, each [`BlockLayout::group_bytes`].
    bytes: super::WeightBytes<u8>,
    rows: usize,
    cols: usize,
    kernel: Kernel,
    format: PhantomData<F>,
}

impl<F: KFormat> std::fmt::Debug for KMatrix<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}Matrix[{}, {}]", F::DTYPE, self.rows, self.cols)
    }
}

pub type Q4KMatrix = KMatrix<Q4K>;
pub type Q5KMatrix = KMatrix<Q5K>;
pub type Q6KMatrix = KMatrix<Q6K>;

impl<F: KFormat> KMatrix<F> {
    fn blocks(&self) -> usize {
        self.cols / QK_K
    }

    fn group(&self, g: usize) -> &[u8] {
        let per_group = self.blocks() * F::LAYOUT.group_bytes();
        &self.bytes[g * per_group..(g + 1) * per_group]
    }

    /// The matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (b, values) in self
            .to_bytes()
            .chunks_exact(F::LAYOUT.bytes)
            .zip(out.chunks_exact_mut(QK_K))
        {
            F::dequantize(b, values);
        }
        out
    }

    /// `x` (`[m, cols]`, row-major) times the transpose of this matrix: `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(self.kernel, x, m)
    }

    /// [`Self::matmul`] with a chosen kernel (tests compare kernels).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.cols);
        let xq = Q8KRows::quantize(x, m);
        let rows: Vec<_> = (0..m).map(|i| xq.row(i)).collect();
        super::matmul_by_groups(self.rows, m, |g, tile, out| {
            F::group_dots(kernel, self.group(g), &rows[tile], out)
        })
    }
}

impl<F: KFormat> Repacked for KMatrix<F> {
    const DTYPE: GgmlDType = F::DTYPE;

    fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        super::block_count(Self::DTYPE, data, (rows, cols))?;
        let (nb, layout) = (cols / QK_K, F::LAYOUT);
        let mut bytes =
            super::WeightBytes::zeroed(rows.div_ceil(GROUP_ROWS) * nb * layout.group_bytes());
        for (i, block) in data.chunks_exact(layout.bytes).enumerate() {
            let (at, k) = super::interleaved(i / nb, i % nb, nb);
            let start = at * layout.group_bytes();
            layout.put(&mut bytes[start..start + layout.group_bytes()], k, block);
        }
        Ok(Self {
            bytes,
            rows,
            cols,
            kernel: Kernel::vector().unwrap_or(Kernel::Scalar),
            format: PhantomData,
        })
    }

    fn to_bytes(&self) -> Vec<u8> {
        let (nb, layout) = (self.blocks(), F::LAYOUT);
        let mut out = Vec::with_capacity(self.rows * nb * layout.bytes);
        for row in 0..self.rows {
            for block in 0..nb {
                let (at, k) = super::interleaved(row, block, nb);
                let start = at * layout.group_bytes();
                out.extend(layout.get(&self.bytes[start..start + layout.group_bytes()], k));
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

    /// Parts whose rows fill whole groups (all but the last) are their groups one after another: their bytes are
    /// copied as they are rather than unpacked and packed again (an 8B file's q/k/v and gate/up, most of its
    /// bytes, loaded that way took a third of the start-up).
    fn concat_rows(parts: &[&Self]) -> Result<Self> {
        let cols = parts.first().map(|p| p.cols).unwrap_or(0);
        let whole_groups = parts
            .split_last()
            .is_some_and(|(_, first)| first.iter().all(|p| p.rows % GROUP_ROWS == 0));
        if parts.iter().any(|p| p.cols != cols) {
            return Err(crate::error::ModelError::Config(format!(
                "{:?} matrices of different widths cannot be stacked",
                F::DTYPE
            )));
        }
        if !whole_groups {
            let mut bytes = Vec::new();
            for p in parts {
                bytes.extend_from_slice(&p.to_bytes());
            }
            return Self::from_bytes(&bytes, parts.iter().map(|p| p.rows).sum(), cols);
        }
        let mut bytes = super::WeightBytes::zeroed(parts.iter().map(|p| p.bytes.len()).sum());
        let mut at = 0;
        for p in parts {
            bytes[at..at + p.bytes.len()].copy_from_slice(&p.bytes);
            at += p.bytes.len();
        }
        Ok(Self {
            bytes,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols,
            kernel: parts[0].kernel,
            format: PhantomData,
        })
    }
}

matmul_op!(Q4KMatrix, "petal-q4_k-matmul");
matmul_op!(Q5KMatrix, "petal-q5_k-matmul");
matmul_op!(Q6KMatrix, "petal-q6_k-matmul");

/// Eight lanes of one row summed as candle's `hsum_float_8`: `(a[i] + a[i + 4])`, then those pairwise.
fn hsum8(a: [f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| a[i + 4] + a[i]);
    (h[0] + h[2]) + (h[1] + h[3])
}

#[cfg(test)]
mod tests;

//! Matmul weights (`y = x W^T`): candle's `QMatMul`, or our own CPU kernels for the formats where candle's are
//! slow (Q4_1, Q5_0 and Q5_1: its generic scalar loops; Q4_0 and Q8_0: a weight row at a time, untiled): weights
//! repacked into groups of [`GROUP_ROWS`] interleaved rows, one task per group ([`matmul_by_groups`]).

// Defined before the kernels' modules, which use it (a `macro_rules!` is visible only after its definition).
/// Runs `$body` for `$r` in `0..$n` (`$n` at most 16, a constant), written out row by row: as a loop, LLVM keeps
/// the rows' accumulators on the stack (a load and a store per row and block) rather than in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! each_row {
    ($n:expr, |$r:ident| $body:block) => {
        each_row!(@ $n, $r, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@ $n:expr, $r:ident, $body:block, $($i:literal)*) => {
        const { assert!($n <= 16, "each_row! writes out at most sixteen rows") };
        $(
            if $i < $n {
                let $r: usize = $i;
                $body
            }
        )*
    };
}

/// Calls `$tile::<$n>(w, rows, out)` on the activation rows `$n` at a time (`$n` at most eight), then once on the
/// fewer than `$n` left, by their count; a single row left goes to `$one` when given, else to `$tile::<1>`. With
/// `$tile[$extra]`, `$extra` follows the row count among the tile's generic arguments (`tile::<8, true>`).
#[cfg(target_arch = "x86_64")]
macro_rules! by_tiles {
    ($tile:ident $([$($extra:tt)*])?, $n:expr, $w:expr, $ys:expr, $out:expr) => {
        by_tiles!($tile $([$($extra)*])?, $n, $w, $ys, $out, |w, ys, out| $tile::<1 $(, $($extra)*)?>(
            w, ys, out
        ))
    };
    ($tile:ident $([$($extra:tt)*])?, $n:expr, $w:expr, $ys:expr, $out:expr, |$ow:ident, $oys:ident, $oout:ident| $one:expr) => {{
        const {
            assert!(
                $n <= 8,
                "by_tiles! writes out remainders of at most seven rows"
            )
        };
        let (w, ys, out) = ($w, $ys, $out);
        let mut r = 0;
        while r + $n <= ys.len() {
            $tile::<{ $n } $(, $($extra)*)?>(w, &ys[r..r + $n], &mut out[r..r + $n]);
            r += $n;
        }
        let (ys, out) = (&ys[r..], &mut out[r..]);
        match ys.len() {
            0 => {}
            1 => {
                let ($ow, $oys, $oout) = (w, ys, out);
                $one
            }
            2 => $tile::<2 $(, $($extra)*)?>(w, ys, out),
            3 => $tile::<3 $(, $($extra)*)?>(w, ys, out),
            4 => $tile::<4 $(, $($extra)*)?>(w, ys, out),
            5 => $tile::<5 $(, $($extra)*)?>(w, ys, out),
            6 => $tile::<6 $(, $($extra)*)?>(w, ys, out),
            _ => $tile::<7 $(, $($extra)*)?>(w, ys, out),
        }
    }};
}

/// The 512-bit kernels' tiles: `$tile::<16>(w, rows, out)` on the activation rows sixteen at a time (each block's
/// weights unpacked once for all of them: 1.02-1.07x faster than two tiles of eight, SmolLM2's Q4_1 matmuls at 16
/// rows on two threads, Zen 4, though their sums and accumulators no longer fit the registers), then the rest in
/// tiles of eight, which do fit ([`by_tiles!`], whose `$tile[$extra]` this takes too).
#[cfg(target_arch = "x86_64")]
macro_rules! by_wide_tiles {
    ($tile:ident $([$($extra:tt)*])?, $w:expr, $ys:expr, $out:expr) => {{
        let (w, ys, out) = ($w, $ys, $out);
        let wide = ys.len() / 16 * 16;
        for (ys, out) in ys[..wide].chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            $tile::<16 $(, $($extra)*)?>(w, ys, out);
        }
        let (ys, out) = (&ys[wide..], &mut out[wide..]);
        by_tiles!($tile $([$($extra)*])?, 8, w, ys, out)
    }};
}

/// In each 32-bit lane (one weight row of an interleaved group), the sum of a block's 32 products of unsigned weight
/// bytes (`q[p]`: values `4p..4p + 4` of the block, `q[p + 4]`: values `4p + 16..4p + 20`) and signed activation
/// bytes (`y`: the block's 32 bytes as eight words, each broadcast to every lane). Two chains of four `dpbusd`, so
/// one row's sums do not wait on one another.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(crate) unsafe fn block_dot_512(
    q: &[std::arch::x86_64::__m512i; 8],
    y: *const i32,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let mut lo = _mm512_setzero_si512();
    let mut hi = _mm512_setzero_si512();
    for p in 0..4 {
        lo = _mm512_dpbusd_epi32(lo, q[p], _mm512_set1_epi32(y.add(p).read_unaligned()));
        hi = _mm512_dpbusd_epi32(
            hi,
            q[p + 4],
            _mm512_set1_epi32(y.add(p + 4).read_unaligned()),
        );
    }
    _mm512_add_epi32(lo, hi)
}

/// Blocks ahead of the one being computed whose weights a kernel asks the first-level cache for: a tile of
/// several activation rows (or an AMX tile) computes long enough per block for the next weights, which come from
/// memory, to arrive late. Measured on a Zen 4 with the hints running on into the next group (Q4_1, SmolLM2's
/// block matmuls from memory, 8 rows, one thread): eight 202-210 us a block against 209-219 for four.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 8;

/// Asks the first-level cache for block `b + PREFETCH_AHEAD` of a group whose blocks of `block_bytes` bytes each
/// start at `first`. Near a group's end that block is the next group's first: every matrix keeps its groups one
/// after another in memory, and a thread takes them in order (a lane all of them, a pool task a run of them), so
/// the next group's blocks arrive before its first block is read rather than all at once as it starts (at 8
/// activation rows, a group of 18 blocks without them: SmolLM2's block matmuls 10% slower from memory).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead<T>(first: *const T, b: usize, block_bytes: usize) {
    prefetch_block::<T, { std::arch::x86_64::_MM_HINT_T0 }>(first, b + PREFETCH_AHEAD, block_bytes);
}

/// Blocks ahead whose weights [`prefetch_far`] asks the second-level cache for.
#[cfg(target_arch = "x86_64")]
const PREFETCH_FAR: usize = 16;

/// Asks the second-level cache for block `b + PREFETCH_FAR` of a group (and on into the next groups, as
/// [`prefetch_ahead`]): for an LM head, whose 30 MB stream from memory while a tile of rows computes, so that
/// each block is in the second-level cache by the time [`prefetch_ahead`] asks for it (SmolLM2's head at 16 rows,
/// one thread: 3.36-3.44 ms against 3.64-3.90 without; 24 and 32 ahead no better, 48 worse). The blocks' own
/// matmuls gain nothing from it: their tiles' weights arrive in time, and the extra hints cost them 10%.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_far<T>(first: *const T, b: usize, block_bytes: usize) {
    prefetch_block::<T, { std::arch::x86_64::_MM_HINT_T1 }>(first, b + PREFETCH_FAR, block_bytes);
}

/// Asks the cache level `HINT` names for every line of block `block` (of `block_bytes` bytes, the first at
/// `first`). Past a matrix's last block it asks for nothing useful: a hint reads nothing and cannot fault.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_block<T, const HINT: i32>(first: *const T, block: usize, block_bytes: usize) {
    let block = first.cast::<i8>().wrapping_add(block * block_bytes);
    for line in (0..block_bytes).step_by(64) {
        // SAFETY: a prefetch hint has no architectural effect, whatever the address; SSE is part of x86-64.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(block.wrapping_add(line)) };
    }
}

/// Our matrix type `$ty` (with methods `rows`, `cols` and `matmul(x, m)`) as a candle op on CPU tensors, named
/// `$name`.
macro_rules! matmul_op {
    ($ty:ty, $name:literal) => {
        impl candle_core::CustomOp1 for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(
                &self,
                storage: &candle_core::CpuStorage,
                layout: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                let dims = (self.rows(), self.cols());
                super::cpu_matmul($name, dims, storage, layout, |x, m| self.matmul(x, m))
            }
        }
    };
}

mod amx;
mod candle_rows;
mod fifth_bits;
pub mod k_quant;
pub mod mxfp4;
pub mod q4_0;
pub mod q4_1;
pub mod q5_0;
pub mod q5_1;
pub mod q8_0;
pub mod q8_1;
mod stacked;
mod weight_bytes;

pub use candle_rows::CandleRows;
pub use k_quant::{Q4KMatrix, Q5KMatrix, Q6KMatrix};
pub use mxfp4::Mxfp4Matrix;
pub use q4_0::Q4_0Matrix;
pub use q4_1::Q4_1Matrix;
pub use q5_0::Q5_0Matrix;
pub use q5_1::Q5_1Matrix;
pub use q8_0::Q8_0Matrix;
pub use stacked::Stacked;
pub(crate) use weight_bytes::WeightBytes;

use crate::error::Result;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, DType, Device, Layout, Module, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum Linear {
    Candle(QMatMul),
    /// Candle's product, a part of the rows on each thread of the calling pool.
    CandleRows(Arc<CandleRows>),
    Q4_0(Arc<Q4_0Matrix>),
    Q4_1(Arc<Q4_1Matrix>),
    Q5_0(Arc<Q5_0Matrix>),
    Q5_1(Arc<Q5_1Matrix>),
    Q8_0(Arc<Q8_0Matrix>),
    Q4K(Arc<Q4KMatrix>),
    Q5K(Arc<Q5KMatrix>),
    Q6K(Arc<Q6KMatrix>),
    Mxfp4(Arc<Mxfp4Matrix>),
}

impl Linear {
    /// A quantized weight: ours where we have a kernel for its format on this device, else candle's.
    pub fn quantized(q: Arc<QTensor>, device: &Device) -> Result<Self> {
        if device.is_cpu() {
            if let Some(m) = Q4_0Matrix::from_qtensor(&q)? {
                return Ok(Self::Q4_0(Arc::new(m)));
            }
            if let Some(m) = Q4_1Matrix::from_qtensor(&q)? {
                return Ok(Self::Q4_1(Arc::new(m)));
            }
            if let Some(m) = Q5_0Matrix::from_qtensor(&q)? {
                return Ok(Self::Q5_0(Arc::new(m)));
            }
            if let Some(m) = Q5_1Matrix::from_qtensor(&q)? {
                return Ok(Self::Q5_1(Arc::new(m)));
            }
            if let Some(m) = Q8_0Matrix::from_qtensor(&q)? {
                return Ok(Self::Q8_0(Arc::new(m)));
            }
            // The K-quants where this CPU runs one of our vector kernels (AVX2 or AVX-512); elsewhere candle's
            // are faster than our scalar reference.
            if k_quant::Kernel::vector().is_some() {
                if let Some(m) = Q4KMatrix::from_qtensor(&q)? {
                    return Ok(Self::Q4K(Arc::new(m)));
                }
                if let Some(m) = Q5KMatrix::from_qtensor(&q)? {
                    return Ok(Self::Q5K(Arc::new(m)));
                }
                if let Some(m) = Q6KMatrix::from_qtensor(&q)? {
                    return Ok(Self::Q6K(Arc::new(m)));
                }
            }
            if let Some(m) = CandleRows::new(&q, rayon::current_num_threads())? {
                return Ok(Self::CandleRows(Arc::new(m)));
            }
        }
        Ok(Self::Candle(QMatMul::from_arc(q)?))
    }

    /// This matrix as an LM head: its output is the logits, never requantized, so a Q8_0 matrix sums each block
    /// exactly ([`q8_0::Summation::Blocks`]), within float rounding of candle's order for far less work.
    pub fn for_logits(self) -> Self {
        match self {
            Self::Q8_0(m) => match Arc::try_unwrap(m) {
                Ok(m) => Self::Q8_0(Arc::new(m.with_summation(q8_0::Summation::Blocks))),
                // Shared: left as it is, since another holder may be a block.
                Err(shared) => Self::Q8_0(shared),
            },
            other => other,
        }
    }

    pub fn dense(w: Tensor) -> Self {
        Self::Candle(QMatMul::Tensor(w))
    }

    /// Whether each output row depends on its input row alone, bit for bit, however many rows are computed at once
    /// (our kernels quantize activations by row and form each output as one row's dot product; candle's kernels
    /// may take another path for more rows).
    pub fn rows_independent(&self) -> bool {
        matches!(
            self,
            Self::Q4_0(_)
                | Self::Q4_1(_)
                | Self::Q5_0(_)
                | Self::Q5_1(_)
                | Self::Q8_0(_)
                | Self::Q4K(_)
                | Self::Q5K(_)
                | Self::Q6K(_)
                | Self::Mxfp4(_)
        )
    }

    /// `x`: `[..., in]` to `[..., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Candle(m) => m.forward(x)?,
            Self::CandleRows(m) => m.forward(x)?,
            Self::Q4_0(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Q4_1(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Q5_0(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Q5_1(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Q8_0(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Q4K(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Q5K(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Q6K(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
            Self::Mxfp4(m) => f32_input(x)?.apply_op1_no_bwd(m.as_ref())?,
        })
    }
}

/// Our kernels take contiguous f32 activations.
fn f32_input(x: &Tensor) -> Result<Tensor> {
    Ok(if x.dtype() == DType::F32 {
        x.contiguous()?
    } else {
        x.to_dtype(DType::F32)?
    })
}

/// The CPU side of our matmul ops: checks that `x` (`[..., cols]`, contiguous f32) fits a `[rows, cols]` weight,
/// runs `matmul(x, m)` over its `m` rows, and gives the result `x`'s leading dims.
pub(crate) fn cpu_matmul(
    name: &str,
    (rows, cols): (usize, usize),
    storage: &CpuStorage,
    layout: &Layout,
    matmul: impl FnOnce(&[f32], usize) -> Vec<f32>,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let dims = layout.dims();
    let k = dims.last().copied().unwrap_or(0);
    if k != cols {
        candle_core::bail!("{name}: input {dims:?} against a [{rows}, {cols}] weight");
    }
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{name}: input must be contiguous");
    };
    let x = &storage.as_slice::<f32>()?[start..end];
    let mut out_dims = dims.to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = rows;
    }
    Ok((
        CpuStorage::F32(matmul(x, x.len() / k)),
        Shape::from(out_dims),
    ))
}

/// The x86 instruction sets our kernels choose between, detected once.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuFeatures {
    /// AVX2 with FMA and F16C: every kernel but the scalar ones needs these.
    pub avx2: bool,
    /// AVX-VNNI (`dpbusd` on 256-bit vectors), on top of `avx2`.
    pub avx_vnni: bool,
    /// AVX-512 F, BW and VNNI, on top of `avx2`.
    pub avx512_vnni: bool,
    /// AMX-INT8 tiles this process may use, on top of `avx512_vnni` (whose kernels take the rows tiles do not).
    pub amx: bool,
}

pub(crate) fn cpu_features() -> CpuFeatures {
    static FEATURES: std::sync::OnceLock<CpuFeatures> = std::sync::OnceLock::new();
    *FEATURES.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512_vnni = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni");
            CpuFeatures {
                avx2,
                avx_vnni: avx2 && is_x86_feature_detected!("avxvnni"),
                avx512_vnni,
                amx: avx512_vnni && amx::usable(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuFeatures::default()
    })
}

/// The kernels of a format that has a scalar reference, an AVX2 and an AVX-512 VNNI version (Q4_0, Q5_0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VectorKernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl VectorKernel {
    /// Every kernel this CPU can run, slowest first (tests check each against the reference).
    pub fn available() -> Vec<Self> {
        let mut all = vec![Self::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = cpu_features();
            if cpu.avx2 {
                all.push(Self::Avx2);
            }
            if cpu.avx512_vnni {
                all.push(Self::Avx512Vnni);
            }
        }
        all
    }

    /// The fastest of [`Self::available`], from the features detected once (every matmul asks).
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = cpu_features();
            if cpu.avx512_vnni {
                return Self::Avx512Vnni;
            }
            if cpu.avx2 {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }
}

/// Weight rows our kernels interleave (one 32-bit lane each of a 512-bit vector), and so the output columns one
/// task computes.
pub const GROUP_ROWS: usize = 16;
/// Bytes of one part of an interleaved block: four consecutive weight bytes of each row of the group, row `k` at
/// `4k`, so one 512-bit load gives every row's next four bytes in its own lane.
pub const PART_BYTES: usize = 4 * GROUP_ROWS;

/// Where block `block` of row `row` lives in a matrix of `blocks` blocks per row, interleaved in groups: the index
/// of its group's block (`group * blocks + block`, by which scales and parts are laid out) and the row's lane `k`
/// in the group (its scale at `GROUP_ROWS * index + k`, its bytes at `4k` in each part).
pub(crate) fn interleaved(row: usize, block: usize, blocks: usize) -> (usize, usize) {
    ((row / GROUP_ROWS) * blocks + block, row % GROUP_ROWS)
}

/// Activation rows a task walks its group's weights over at a time, kept hot in cache while it does.
const ACTIVATION_ROWS_PER_TILE: usize = 64;

/// The `[m, n]` output of a matmul whose `n` output columns come in groups of [`GROUP_ROWS`]: one rayon task per
/// group, which calls `dots(group, rows, out)` for each tile of activation rows to fill `out[i]` with row
/// `rows.start + i`'s outputs (the last group's columns past `n` are dropped).
pub(crate) fn matmul_by_groups(
    n: usize,
    m: usize,
    dots: impl Fn(usize, std::ops::Range<usize>, &mut [[f32; GROUP_ROWS]]) + Sync,
) -> Vec<f32> {
    // Every element is written below (the groups cover every column, the tiles every row), so the buffer is not
    // zeroed first: for the LM head of a decode step that would be a pass over 192 KiB for nothing.
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let dst = SharedOut(out.as_mut_ptr());
    (0..n.div_ceil(GROUP_ROWS)).into_par_iter().for_each_init(
        // One tile buffer per batch of tasks rayon hands a thread, not one per group.
        || vec![[0f32; GROUP_ROWS]; ACTIVATION_ROWS_PER_TILE.min(m)],
        |tile_out, g| {
            let first = g * GROUP_ROWS;
            let width = GROUP_ROWS.min(n - first);
            for tile in (0..m).step_by(ACTIVATION_ROWS_PER_TILE) {
                let rows = tile..(tile + ACTIVATION_ROWS_PER_TILE).min(m);
                dots(g, rows.clone(), tile_out);
                for (i, v) in tile_out[..rows.len()].iter().enumerate() {
                    // SAFETY: `(tile + i) * n + first + width` is at most the buffer's capacity (tile + i < m,
                    // first + width <= n), and columns `first..first + width` belong to this task alone, so no
                    // two tasks write the same element.
                    unsafe { dst.write((tile + i) * n + first, v, width) };
                }
            }
        },
    );
    // SAFETY: the loop above wrote all `m * n` elements (every row of every group's columns).
    unsafe { out.set_len(m * n) };
    out
}

/// [`matmul_by_groups`] for the kernels that take activations as [`q8_1::Q8Rows`] (Q4_1, Q5_0, Q5_1): `x` (`[m, k]`)
/// quantized once, with the 256-bit kernels' splat scales when `splat`, and `dots(group, rows, out)` for each
/// group and tile of rows.
pub(crate) fn matmul_q8_rows(
    n: usize,
    (x, m): (&[f32], usize),
    splat: bool,
    dots: impl Fn(usize, &[q8_1::Q8Row<'_>], &mut [[f32; GROUP_ROWS]]) + Sync,
) -> Vec<f32> {
    let xq = q8_1::Q8Rows::quantize(x, m, splat);
    let rows: Vec<q8_1::Q8Row<'_>> = (0..m).map(|i| xq.row(i)).collect();
    matmul_by_groups(n, m, |g, tile, out| dots(g, &rows[tile], out))
}

/// The output buffer, shared by tasks that write disjoint columns.
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements and the buffer outlives the parallel loop that uses it.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Writes `v[..width]` at element `at`.
    unsafe fn write(&self, at: usize, v: &[f32; GROUP_ROWS], width: usize) {
        let to = self.0.add(at);
        if width == GROUP_ROWS {
            // A whole group, the common case: a fixed-size copy the compiler writes as a few vector moves, where a
            // copy of a run-time length is a call to `memmove` (one per row and group: 2.5% of the samples of the
            // 16-session test).
            to.cast::<[f32; GROUP_ROWS]>().write_unaligned(*v);
        } else {
            std::ptr::copy_nonoverlapping(v.as_ptr(), to, width);
        }
    }
}

/// The blocks of a `[rows, cols]` matrix of ggml `dtype` blocks held in `data`, or why `data` is not one.
pub(crate) fn block_count(
    dtype: GgmlDType,
    data: &[u8],
    (rows, cols): (usize, usize),
) -> Result<usize> {
    let (per_block, block_bytes) = (dtype.block_size(), dtype.type_size());
    let n = rows * cols / per_block;
    if !cols.is_multiple_of(per_block) || data.len() != n * block_bytes {
        return Err(crate::error::ModelError::Config(format!(
            "{} bytes of {dtype:?} data for a [{rows}, {cols}] matrix",
            data.len()
        )));
    }
    Ok(n)
}

/// One of our matrix types built from ggml's blocks, row by row, that gives them back: all that stacking several
/// into one takes.
pub trait Repacked: Sized {
    /// The ggml format of the blocks.
    const DTYPE: GgmlDType;

    /// Repacks a `QTensor` of [`Self::DTYPE`]; `None` for any other format or shape.
    fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        let dims = q.shape().dims();
        if q.dtype() != Self::DTYPE
            || dims.len() != 2
            || !dims[1].is_multiple_of(Self::DTYPE.block_size())
        {
            return Ok(None);
        }
        let data = q.data()?;
        Ok(Some(Self::from_bytes(&data, dims[0], dims[1])?))
    }

    /// Repacks raw ggml blocks (row by row) into interleaved groups.
    fn from_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Self>;

    /// The matrix as ggml's row-by-row blocks again: the bytes [`Self::from_bytes`] took.
    fn to_bytes(&self) -> Vec<u8>;

    fn rows(&self) -> usize;

    fn cols(&self) -> usize;

    /// The rows of several matrices of the same width, one after another: one matmul instead of several over
    /// the same input (queries, keys and values; gate and up).
    fn concat_rows(parts: &[&Self]) -> Result<Self> {
        let cols = parts.first().map(|p| p.cols()).unwrap_or(0);
        if parts.iter().any(|p| p.cols() != cols) {
            return Err(crate::error::ModelError::Config(format!(
                "{:?} matrices of different widths cannot be stacked",
                Self::DTYPE
            )));
        }
        let mut bytes = Vec::new();
        for p in parts {
            bytes.extend_from_slice(&p.to_bytes());
        }
        Self::from_bytes(&bytes, parts.iter().map(|p| p.rows()).sum(), cols)
    }
}

/// Nibble bytes of one block of an interleaved group (Q4_0, Q4_1, Q5_0, Q5_1): four parts.
pub(crate) const NIBBLE_BLOCK_QS: usize = 4 * PART_BYTES;

/// Writes a block's sixteen nibble bytes (ggml's order) as lane `k` of block `at` of an interleaved group: byte
/// `4p + t` to byte `t` of the lane in part `p`.
pub(crate) fn put_nibbles(qs: &mut [u8], (at, k): (usize, usize), bytes: &[u8]) {
    for (p, bytes) in bytes.chunks_exact(4).enumerate() {
        let q = at * NIBBLE_BLOCK_QS + p * PART_BYTES + 4 * k;
        qs[q..q + 4].copy_from_slice(bytes);
    }
}

/// The sixteen nibble bytes of lane `k` of block `at`, in ggml's order again ([`put_nibbles`] undone).
pub(crate) fn nibbles(qs: &[u8], (at, k): (usize, usize)) -> impl Iterator<Item = &u8> {
    (0..4).flat_map(move |p| {
        let q = at * NIBBLE_BLOCK_QS + p * PART_BYTES + 4 * k;
        &qs[q..q + 4]
    })
}

/// `a`, repacked from `q`, gives `q`'s bytes back, and `a` stacked over `b` gives each one's outputs bit for bit
/// (`matmul`: the type's product). With 37 rows in `a`, `b`'s rows start inside `a`'s last group.
#[cfg(test)]
pub(crate) fn assert_repacks_and_stacks<M: Repacked>(
    (q, a): (&QTensor, &M),
    b: &M,
    matmul: impl Fn(&M, &[f32], usize) -> Vec<f32>,
) {
    assert_eq!(a.to_bytes(), q.data().expect("the tensor's bytes").to_vec());
    let both = M::concat_rows(&[a, b]).expect("stacked rows");
    let (ra, rb, cols) = (a.rows(), b.rows(), a.cols());
    assert_eq!((both.rows(), both.cols()), (ra + rb, cols));
    let x: Vec<f32> = test_matrix(3, cols, 5)
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("activations");
    let (ya, yb, y) = (matmul(a, &x, 3), matmul(b, &x, 3), matmul(&both, &x, 3));
    for (r, y) in y.chunks_exact(ra + rb).enumerate() {
        assert_eq!(y[..ra], ya[r * ra..(r + 1) * ra]);
        assert_eq!(y[ra..], yb[r * rb..(r + 1) * rb]);
    }
}

/// A format's product with one chosen kernel (`matmul_with`), as the kernels' tests call it.
#[cfg(test)]
pub(crate) type KernelProduct<M, K> = fn(&M, K, &[f32], usize) -> Vec<f32>;

/// Every kernel in `kernels` gives candle's product bit for bit: a random `M::DTYPE` matrix of 37 rows (two full
/// groups and a partial one) for each width in `cols`, against each count of activation rows in `rows`.
#[cfg(test)]
pub(crate) fn assert_every_kernel_equals_candle<M: Repacked, K: Copy + std::fmt::Debug>(
    kernels: &[K],
    (cols, rows): (&[usize], &[usize]),
    seed: u64,
    matmul: KernelProduct<M, K>,
) {
    for &c in cols {
        let q = QTensor::quantize(&test_matrix(37, c, seed), M::DTYPE).expect("quantized");
        let m = M::from_qtensor(&q)
            .expect("repacked")
            .expect("one of our formats");
        let candle = QMatMul::from_qtensor(q).expect("candle's matrix");
        for &r in rows {
            let (want, xs) = candle_product(&candle, &test_matrix(r, c, r as u64));
            for &kernel in kernels {
                let got = matmul(&m, kernel, &xs, r);
                assert_eq!(got, want, "{:?}, {kernel:?}, {r} rows of {c}", M::DTYPE);
            }
        }
    }
}

/// Hand-made ggml blocks (`data`, `[rows, cols]` of `M::DTYPE`) repack and give their bytes back, and every kernel
/// in `kernels` gives candle's product with `x` bit for bit.
#[cfg(test)]
pub(crate) fn assert_blocks_equal_candle<M: Repacked, K: Copy + std::fmt::Debug>(
    (data, rows, cols): (&[u8], usize, usize),
    x: &Tensor,
    kernels: &[K],
    matmul: KernelProduct<M, K>,
) {
    let m = M::from_bytes(data, rows, cols).expect("repacked");
    assert_eq!(m.to_bytes(), data);
    let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
        M::DTYPE,
        data,
        vec![rows, cols],
        &Device::Cpu,
    )
    .expect("candle's matrix");
    let candle = QMatMul::from_qtensor(q).expect("candle's matrix");
    let (want, xs) = candle_product(&candle, x);
    for &kernel in kernels {
        let got = matmul(&m, kernel, &xs, x.dims()[0]);
        assert_eq!(got, want, "{:?}, {kernel:?}", M::DTYPE);
    }
}

/// Reproducible uniform values in [-0.5, 0.5) for the kernels' tests.
#[cfg(test)]
pub(crate) fn test_matrix(rows: usize, cols: usize, seed: u64) -> Tensor {
    let mut s = seed;
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).expect("a tensor of the right size")
}

/// A matrix op's checks shared by our formats' tests: it keeps a `[2, 3, cols]` input's leading dims, giving
/// `[2, 3, rows]`, and refuses an input of another width.
#[cfg(test)]
pub(crate) fn assert_op_shapes(op: &impl candle_core::CustomOp1, rows: usize, cols: usize) {
    let x = Tensor::zeros((2, 3, cols), DType::F32, &Device::Cpu).expect("zeros");
    assert_eq!(
        x.apply_op1_no_bwd(op).expect("the op").dims(),
        &[2, 3, rows]
    );
    let bad = Tensor::zeros((2, cols / 2), DType::F32, &Device::Cpu).expect("zeros");
    assert!(bad.apply_op1_no_bwd(op).is_err());
}

/// `ours` (a matrix dequantized by our code) is candle's dequantization of `q`, bit for bit.
#[cfg(test)]
pub(crate) fn assert_dequantizes_like_candle(q: &QTensor, ours: &[f32]) {
    let want = q
        .dequantize(&Device::Cpu)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("candle's dequantization");
    assert_eq!(ours.len(), want.len());
    assert!(ours
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// The kernels' tests' reference: candle's product of `x` (`[rows, cols]`) by `w`, flattened, beside `x` flattened
/// for our kernels.
#[cfg(test)]
pub(crate) fn candle_product(w: &QMatMul, x: &Tensor) -> (Vec<f32>, Vec<f32>) {
    let flat = |t: &Tensor| {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("an f32 tensor")
    };
    (flat(&w.forward(x).expect("candle's product")), flat(x))
}

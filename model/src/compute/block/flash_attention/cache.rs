//! The KV cache as the flash-attention kernel reads it: a view of keys or values (`[batch, kv_heads, len,
//! head_dim]` with contiguous rows) over f32 or f16 elements, handing the inner loops a chunk of rows either where
//! they lie or widened to f32 once.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout};
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::ops::Range;

/// Query rows of a tile up to which an f16 cache is read in place rather than widened into a buffer first: a
/// decode step's rows are its group (3 for SmolLM2, 4 to 8 for most GQA models).
const READ_IN_PLACE_ROWS: usize = 4;

/// The cache's elements: f32, or f16 widened as they are read (a chunk of positions at a time into a buffer, or
/// in registers by the inner loops themselves).
#[derive(Clone, Copy)]
pub(super) enum Elems<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl<'a> Elems<'a> {
    pub(super) fn range(self, r: Range<usize>) -> Self {
        match self {
            Elems::F32(x) => Elems::F32(&x[r]),
            Elems::F16(x) => Elems::F16(&x[r]),
        }
    }
}

/// Keys or values of the cache, as the kernel reads them.
#[derive(Clone, Copy)]
pub(crate) struct Cache<'a> {
    data: Elems<'a>,
    offset: usize,
    batch_stride: usize,
    head_stride: usize,
}

impl<'a> Cache<'a> {
    /// Keys or values of an f16 cache in host memory: `[batch, kv_heads, capacity, head_dim]`, row-major.
    pub(crate) fn host(data: &'a [f16], (kv_heads, capacity, d): (usize, usize, usize)) -> Self {
        Self {
            data: Elems::F16(data),
            offset: 0,
            batch_stride: kv_heads * capacity * d,
            head_stride: capacity * d,
        }
    }

    /// An f32 cache of `data` from its start, sequences and heads the given strides apart (tests).
    #[cfg(test)]
    pub(super) fn f32(data: &'a [f32], batch_stride: usize, head_stride: usize) -> Self {
        Self {
            data: Elems::F32(data),
            offset: 0,
            batch_stride,
            head_stride,
        }
    }

    /// Rows `first..first + n` of head `h` of sequence `b` (contiguous in the cache), as stored.
    fn stored(&self, (b, h, first, n, d): (usize, usize, usize, usize, usize)) -> Elems<'a> {
        let start = self.offset + b * self.batch_stride + h * self.head_stride + first * d;
        self.data.range(start..start + n * d)
    }

    /// The same rows in f32: borrowed from an f32 cache, widened into `buf` from an f16 one.
    fn rows<'s>(
        &'s self,
        at: (usize, usize, usize, usize, usize),
        buf: &'s mut [f32],
    ) -> &'s [f32] {
        match self.stored(at) {
            Elems::F32(x) => x,
            Elems::F16(x) => {
                x.convert_to_f32_slice(&mut buf[..x.len()]);
                &buf[..x.len()]
            }
        }
    }

    /// The rows as the inner loops read them: widened once into `buf` when many query rows will read each (a
    /// prompt's tile), read where they lie when few do (a decode step's group), since widening in registers is
    /// then cheaper than writing and reading back a copy.
    pub(super) fn for_rows<'s>(
        &'s self,
        at: (usize, usize, usize, usize, usize),
        readers: usize,
        buf: &'s mut [f32],
    ) -> Elems<'s> {
        if self.widens(readers) {
            Elems::F32(self.rows(at, buf))
        } else {
            self.stored(at)
        }
    }

    /// Whether [`Self::for_rows`] widens into its buffer for this many reading rows.
    pub(super) fn widens(&self, readers: usize) -> bool {
        matches!(self.data, Elems::F16(_)) && readers > READ_IN_PLACE_ROWS
    }
}

/// The cache's layout as the kernel reads it: `[batch, kv_heads, len, head_dim]` with contiguous rows.
pub(super) fn cache_view<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
    (batch, kv_heads, d): (usize, usize, usize),
) -> candle_core::Result<(Cache<'a>, usize)> {
    let (data, elems) = match s {
        CpuStorage::F32(v) => (Elems::F32(v), v.len()),
        CpuStorage::F16(v) => (Elems::F16(v), v.len()),
        other => candle_core::bail!(
            "flash attention: {what} are {:?}, not f32 or f16",
            other.dtype()
        ),
    };
    let (dims, stride) = (l.dims(), l.stride());
    if dims.len() != 4 || dims[0] != batch || dims[1] != kv_heads || dims[3] != d {
        candle_core::bail!(
            "flash attention: {what} {dims:?} for queries with {batch} x {kv_heads} x {d}"
        );
    }
    if stride[3] != 1 || stride[2] != d {
        candle_core::bail!("flash attention: {what} rows are not contiguous ({stride:?})");
    }
    let len = dims[2];
    let last = l.start_offset() + (batch - 1) * stride[0] + (kv_heads - 1) * stride[1] + len * d;
    if len > 0 && last > elems {
        candle_core::bail!("flash attention: {what} layout runs past its storage");
    }
    let view = Cache {
        data,
        offset: l.start_offset(),
        batch_stride: stride[0],
        head_stride: stride[1],
    };
    Ok((view, len))
}

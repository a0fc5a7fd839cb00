//! One block's keys and values for one session, on that block's device and dtype, written in place.
//!
//! The buffers are `[batch, kv_heads, capacity, head_dim]`; a step writes its new positions into them and nothing
//! older is copied. Capacity grows geometrically (so a long conversation copies its past O(log n) times, not once
//! per step) and never beyond the session's `max_length`, the positions its reservation paid for.
use crate::compute::placement::{normalise, Placement};
use crate::error::{ModelError, Result};
use candle_core::Tensor;

/// The smallest capacity allocated, in positions: short sessions grow at most a few times.
const MIN_CAPACITY: usize = 64;

#[derive(Debug)]
pub struct KvCache {
    placement: Placement,
    /// Keys and values; positions `0..len` are valid, the rest is room to grow.
    buffers: Option<(Tensor, Tensor)>,
    len: usize,
    max_len: usize,
}

impl KvCache {
    /// An empty cache that will hold at most `max_len` positions.
    pub fn new(placement: Placement, max_len: usize) -> Self {
        Self {
            placement,
            buffers: None,
            len: 0,
            max_len,
        }
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the buffers can hold before they grow.
    pub fn capacity(&self) -> usize {
        self.buffers.as_ref().map(|(k, _)| k.dims()[2]).unwrap_or(0)
    }

    /// Bytes of device memory the cache holds (its capacity, not just the positions used).
    pub fn bytes(&self) -> usize {
        self.buffers
            .as_ref()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .unwrap_or(0)
    }

    /// Writes new keys/values (`[batch, kv_heads, tokens, head_dim]`) after those held. They are normalised to the
    /// cache's placement first, so a key computed elsewhere can never meet the cache across devices or dtypes.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let k = normalise(k, &self.placement)?.contiguous()?;
        let v = normalise(v, &self.placement)?.contiguous()?;
        let (b, heads, tokens, dim) = k.dims4()?;
        if v.dims() != k.dims() {
            return Err(shape_error("values", k.dims(), v.dims()));
        }
        if let Some((held, _)) = &self.buffers {
            let held = held.dims();
            if (held[0], held[1], held[3]) != (b, heads, dim) {
                return Err(shape_error("keys", held, k.dims()));
            }
        }
        if self.len + tokens > self.max_len {
            return Err(ModelError::TooLong {
                position: self.len,
                tokens,
                max_length: self.max_len,
            });
        }
        self.reserve(self.len + tokens, (b, heads, dim))?;
        if let Some((kb, vb)) = &self.buffers {
            kb.slice_set(&k, 2, self.len)?;
            vb.slice_set(&v, 2, self.len)?;
        }
        self.len += tokens;
        Ok(())
    }

    /// The positions held, as views into the buffers (`[batch, kv_heads, len, head_dim]`, not contiguous once the
    /// capacity exceeds the length).
    pub fn keys_values(&self) -> Option<(Tensor, Tensor)> {
        let (k, v) = self.buffers.as_ref()?;
        Some((
            k.narrow(2, 0, self.len).ok()?,
            v.narrow(2, 0, self.len).ok()?,
        ))
    }

    /// Replaces the contents with keys/values restored from elsewhere (a snapshot, another node, a replay),
    /// normalised to this cache's placement whatever device and dtype they arrive in.
    pub fn restore(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.clear();
        self.append(k, v)
    }

    /// Contiguous copies of the keys and values held, for snapshots and tests.
    pub fn snapshot(&self) -> Option<(Tensor, Tensor)> {
        let (k, v) = self.keys_values()?;
        Some((k.contiguous().ok()?, v.contiguous().ok()?))
    }

    /// Positions the cache may hold at most.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Raises the most positions the cache may hold (a session extended); what is held stays where it is.
    pub fn extend(&mut self, max_len: usize) {
        self.max_len = self.max_len.max(max_len);
    }

    pub fn clear(&mut self) {
        self.buffers = None;
        self.len = 0;
    }

    /// Makes room for `needed` positions: doubles the capacity (at least [`MIN_CAPACITY`], at most `max_len`) and
    /// moves what is held into the new buffers.
    fn reserve(&mut self, needed: usize, (b, heads, dim): (usize, usize, usize)) -> Result<()> {
        let capacity = self.capacity();
        if needed <= capacity {
            return Ok(());
        }
        let grown = (capacity * 2)
            .max(MIN_CAPACITY)
            .max(needed)
            .min(self.max_len);
        let p = &self.placement;
        let alloc = || Tensor::zeros((b, heads, grown, dim), p.dtype, &p.device);
        let (k, v) = (alloc()?, alloc()?);
        if let Some((old_k, old_v)) = self.keys_values() {
            k.slice_set(&old_k.contiguous()?, 2, 0)?;
            v.slice_set(&old_v.contiguous()?, 2, 0)?;
        }
        self.buffers = Some((k, v));
        Ok(())
    }
}

fn shape_error(what: &str, expected: &[usize], actual: &[usize]) -> ModelError {
    ModelError::TensorShape {
        name: format!("cached {what}"),
        expected: expected.to_vec(),
        actual: actual.to_vec(),
    }
}

//! One block's keys and values for one session, on that block's device and dtype, written in place.
//!
//! The buffers are `[batch, kv_heads, capacity, head_dim]`; a step writes its new positions into them and nothing
//! older is copied. A cache of tensors holds keys and values as the two halves of one `[2, batch, kv_heads,
//! capacity, head_dim]` tensor, the layout of an arena's extent too. Capacity grows geometrically (so a long
//! conversation copies its past O(log n) times, not once per step) and never beyond the session's `max_length`,
//! the positions its reservation paid for.
//!
//! An f16 cache on the CPU keeps its buffers as plain vectors rather than candle tensors: the batched attention
//! ([`super::host_attention`]) writes every session's new keys and values into them and reads them back within one
//! parallel region, with no candle op (and no allocation) per session. A cache on a GPU holds an extent of its
//! block's [`KvArena`] (one tensor for every session's cache, so that a batch of their steps writes and reads them
//! all with one op each, [`super::decode_attention`]); every other cache holds candle tensors of its own.
use super::kv_arena::{Extent, KvArena};
use crate::compute::placement::{normalise, Placement};
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;
use std::sync::Arc;

/// The smallest capacity allocated, in positions: short sessions grow at most a few times.
const MIN_CAPACITY: usize = 64;

#[derive(Debug)]
pub struct KvCache {
    placement: Placement,
    /// Keys and values; positions `0..len` are valid, the rest is room to grow.
    buffers: Option<Buffers>,
    /// Whether buffers are [`HostKv`] (an f16 cache on the CPU) or tensors.
    host: bool,
    /// Where a cache of one sequence takes its buffers from, if not tensors of its own.
    arena: Option<Arc<KvArena>>,
    len: usize,
    max_len: usize,
}

#[derive(Debug)]
enum Buffers {
    /// Keys and values, `[2, batch, kv_heads, capacity, head_dim]`.
    Tensors(Tensor),
    Host(HostKv),
    /// Positions of an arena, `[2, kv_heads, capacity, head_dim]` (one sequence).
    Arena(Extent),
}

/// f16 keys and values in host memory, each `[batch, kv_heads, capacity, head_dim]` row-major.
#[derive(Debug)]
pub(crate) struct HostKv {
    pub k: Vec<f16>,
    pub v: Vec<f16>,
    /// `(batch, kv_heads, capacity, head_dim)`.
    pub dims: (usize, usize, usize, usize),
}

impl HostKv {
    /// Where position `t` of head `h` of sequence `b` starts.
    pub fn at(&self, b: usize, h: usize, t: usize) -> usize {
        let (_, heads, capacity, d) = self.dims;
        ((b * heads + h) * capacity + t) * d
    }
}

impl KvCache {
    /// An empty cache that will hold at most `max_len` positions.
    pub fn new(placement: Placement, max_len: usize) -> Self {
        let host = matches!(placement.device, Device::Cpu) && placement.dtype == DType::F16;
        Self {
            placement,
            buffers: None,
            host,
            arena: None,
            len: 0,
            max_len,
        }
    }

    /// An empty cache of at most `max_len` positions whose buffers are an extent of `arena` (when it holds one
    /// sequence of the arena's heads; tensors of its own otherwise).
    pub(crate) fn in_arena(arena: Arc<KvArena>, max_len: usize) -> Self {
        Self {
            host: false,
            arena: Some(arena.clone()),
            ..Self::new(arena.placement().clone(), max_len)
        }
    }

    /// An empty cache whose buffers are candle tensors whatever its placement: the path every cache took before
    /// host buffers, kept as the reference the batched attention is tested against.
    #[cfg(test)]
    pub(crate) fn with_tensor_buffers(placement: Placement, max_len: usize) -> Self {
        Self {
            host: false,
            ..Self::new(placement, max_len)
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
        match &self.buffers {
            Some(Buffers::Tensors(kv)) => kv.dims()[3],
            Some(Buffers::Host(h)) => h.dims.2,
            Some(Buffers::Arena(e)) => e.capacity(),
            None => 0,
        }
    }

    /// Bytes of device memory the cache holds (its capacity, not just the positions used).
    pub fn bytes(&self) -> usize {
        match &self.buffers {
            Some(Buffers::Tensors(kv)) => kv.elem_count() * kv.dtype().size_in_bytes(),
            Some(Buffers::Host(h)) => (h.k.len() + h.v.len()) * std::mem::size_of::<f16>(),
            Some(Buffers::Arena(e)) => {
                let (heads, dim) = e.arena().dims();
                2 * heads * e.capacity() * dim * self.placement.dtype.size_in_bytes()
            }
            None => 0,
        }
    }

    /// Whether the buffers are host vectors that [`Self::host_step`] hands out.
    pub(crate) fn is_host(&self) -> bool {
        self.host
    }

    /// The arena the cache takes its buffers from, if any.
    pub(crate) fn arena(&self) -> Option<&Arc<KvArena>> {
        self.arena.as_ref()
    }

    /// The extent of the arena holding the cache, once it holds any.
    pub(crate) fn extent(&self) -> Option<&Extent> {
        match &self.buffers {
            Some(Buffers::Arena(e)) => Some(e),
            _ => None,
        }
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
        let len = self.len;
        match self.host_step((b, heads, dim), tokens)? {
            Some(host) => {
                let (kv, vv) = (
                    k.flatten_all()?.to_vec1::<f16>()?,
                    v.flatten_all()?.to_vec1::<f16>()?,
                );
                for (i, (kr, vr)) in kv
                    .chunks_exact(tokens * dim)
                    .zip(vv.chunks_exact(tokens * dim))
                    .enumerate()
                {
                    let at = host.at(i / heads, i % heads, len);
                    host.k[at..at + kr.len()].copy_from_slice(kr);
                    host.v[at..at + vr.len()].copy_from_slice(vr);
                }
            }
            None => match &self.buffers {
                Some(Buffers::Tensors(kv)) => {
                    kv.get(0)?.slice_set(&k, 2, len)?;
                    kv.get(1)?.slice_set(&v, 2, len)?;
                }
                Some(Buffers::Arena(e)) => e.write_halves(&k.squeeze(0)?, &v.squeeze(0)?, len)?,
                _ => {}
            },
        }
        self.len += tokens;
        Ok(())
    }

    /// For a host cache, room for `tokens` more positions of `(batch, kv_heads, head_dim)` rows, and the buffers to
    /// write them into at [`Self::len`]; the caller writes them, then calls [`Self::advance`]. `None` for a cache of
    /// tensors (after the same checks and reservation).
    pub(crate) fn host_step(
        &mut self,
        (b, heads, dim): (usize, usize, usize),
        tokens: usize,
    ) -> Result<Option<&mut HostKv>> {
        let held = match &self.buffers {
            Some(Buffers::Tensors(kv)) => Some(kv.dims()[1..].to_vec()),
            Some(Buffers::Host(h)) => Some(vec![h.dims.0, h.dims.1, h.dims.2, h.dims.3]),
            Some(Buffers::Arena(e)) => {
                let (heads, dim) = e.arena().dims();
                Some(vec![1, heads, e.capacity(), dim])
            }
            None => None,
        };
        if let Some(held) = held {
            if (held[0], held[1], held[3]) != (b, heads, dim) {
                return Err(shape_error("keys", &held, &[b, heads, tokens, dim]));
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
        Ok(match &mut self.buffers {
            Some(Buffers::Host(h)) => Some(h),
            _ => None,
        })
    }

    /// Counts `tokens` positions written through [`Self::host_step`].
    pub(crate) fn advance(&mut self, tokens: usize) {
        self.len += tokens;
    }

    /// The host buffers and the positions they hold, for reading.
    pub(crate) fn host(&self) -> Option<(&HostKv, usize)> {
        match &self.buffers {
            Some(Buffers::Host(h)) => Some((h, self.len)),
            _ => None,
        }
    }

    /// Keys and values of the positions held as one view, `[2, batch, kv_heads, len, head_dim]`, for a cache of
    /// tensors; `None` for a host cache or an empty one.
    pub(crate) fn pair(&self) -> Option<Tensor> {
        match self.buffers.as_ref()? {
            Buffers::Tensors(kv) => kv.narrow(3, 0, self.len).ok(),
            Buffers::Arena(e) => e.view(self.len).ok()?.unsqueeze(1).ok(),
            Buffers::Host(_) => None,
        }
    }

    /// The positions held (`[batch, kv_heads, len, head_dim]`): views into tensor buffers (not contiguous once
    /// the capacity exceeds the length), copies of host ones.
    pub fn keys_values(&self) -> Option<(Tensor, Tensor)> {
        match self.buffers.as_ref()? {
            Buffers::Tensors(_) | Buffers::Arena(_) => {
                let kv = self.pair()?;
                Some((kv.get(0).ok()?, kv.get(1).ok()?))
            }
            Buffers::Host(h) => {
                let (b, heads, _, d) = h.dims;
                let take = |x: &[f16]| -> Option<Tensor> {
                    let mut out = Vec::with_capacity(b * heads * self.len * d);
                    for i in 0..b * heads {
                        let at = h.at(i / heads, i % heads, 0);
                        out.extend_from_slice(&x[at..at + self.len * d]);
                    }
                    Tensor::from_vec(out, (b, heads, self.len, d), &Device::Cpu).ok()
                };
                Some((take(&h.k)?, take(&h.v)?))
            }
        }
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
        if self.host {
            let elems = b * heads * grown * dim;
            let mut new = HostKv {
                k: vec![f16::ZERO; elems],
                v: vec![f16::ZERO; elems],
                dims: (b, heads, grown, dim),
            };
            if let Some(Buffers::Host(old)) = &self.buffers {
                let n = self.len * dim;
                for i in 0..b * heads {
                    let (from, to) = (
                        old.at(i / heads, i % heads, 0),
                        new.at(i / heads, i % heads, 0),
                    );
                    new.k[to..to + n].copy_from_slice(&old.k[from..from + n]);
                    new.v[to..to + n].copy_from_slice(&old.v[from..from + n]);
                }
            }
            self.buffers = Some(Buffers::Host(new));
            return Ok(());
        }
        if let Some(arena) = self
            .arena
            .clone()
            .filter(|a| b == 1 && a.dims() == (heads, dim))
        {
            // What is held moves into the new extent; the old one is released as it is replaced.
            if let Some(grown) = arena.allocate(grown, self.extent(), self.len)? {
                self.buffers = Some(Buffers::Arena(grown));
                return Ok(());
            }
            // No room in a bounded arena: tensors of its own from now on, what the extent held copied into them.
            self.arena = None;
        }
        let p = &self.placement;
        let kv = Tensor::zeros((2, b, heads, grown, dim), p.dtype, &p.device)?;
        if let Some(old) = self.pair() {
            kv.slice_set(&old.contiguous()?, 3, 0)?;
        }
        self.buffers = Some(Buffers::Tensors(kv));
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

#[cfg(test)]
mod tests {
    use super::{KvArena, KvCache};
    use crate::compute::placement::Placement;
    use candle_core::{DType, Device, Tensor};

    fn values(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// Caches of one sequence in one arena hold what caches of tensors of their own hold, in both dtypes, as two
    /// of them grow in turn past the smallest capacity (moving each other's extents and growing the arena); a
    /// cache of two sequences takes tensors of its own; clearing and dropping give the extents back.
    #[test]
    fn arena_caches_hold_what_caches_of_tensors_hold() {
        for dtype in [DType::F32, DType::F16] {
            let placement = Placement::new(Device::Cpu, dtype);
            let arena = KvArena::new(placement.clone(), 2, 8, None);
            let mut own = KvCache::with_tensor_buffers(placement.clone(), 200);
            let mut shared = [
                KvCache::in_arena(arena.clone(), 200),
                KvCache::in_arena(arena.clone(), 200),
            ];
            let mut seed = 0u64;
            for tokens in [3, 1, 70, 1, 1, 60] {
                seed += 1;
                let kv = crate::compute::linear::test_matrix(2 * 2 * tokens, 8, seed)
                    .reshape((2, 1, 2, tokens, 8))
                    .unwrap();
                let (k, v) = (kv.get(0).unwrap(), kv.get(1).unwrap());
                own.append(&k, &v).unwrap();
                let (ok, ov) = own.keys_values().unwrap();
                for cache in shared.iter_mut() {
                    cache.append(&k, &v).unwrap();
                    assert_eq!((cache.len(), cache.capacity()), (own.len(), own.capacity()));
                    let (k, v) = cache.keys_values().unwrap();
                    assert_eq!(values(&k), values(&ok));
                    assert_eq!(values(&v), values(&ov));
                    let pair = cache.pair().unwrap();
                    assert_eq!(pair.dims(), [2, 1, 2, cache.len(), 8]);
                    assert_eq!(values(&pair.get(1).unwrap()), values(&ov));
                }
            }
            assert!(shared.iter().all(|c| c.extent().is_some()));
            assert!(arena.capacity() >= 2 * own.capacity() && own.capacity() >= 136);
            let mut two = KvCache::in_arena(arena.clone(), 8);
            let kv = Tensor::zeros((2, 2, 1, 8), dtype, &Device::Cpu).unwrap();
            two.append(&kv, &kv).unwrap();
            assert!(two.extent().is_none() && two.pair().is_some());
            let [mut first, second] = shared;
            first.clear();
            assert!(first.extent().is_none() && arena.capacity() > 0);
            drop(second);
            assert_eq!(arena.capacity(), 0);
        }
    }

    /// A cache that outgrows a bounded arena takes tensors of its own and keeps what it held; the others stay in
    /// the arena.
    #[test]
    fn a_cache_outgrowing_a_bounded_arena_keeps_its_keys_in_tensors_of_its_own() {
        let placement = Placement::new(Device::Cpu, DType::F16);
        let arena = KvArena::new(placement.clone(), 2, 8, Some(128));
        let (mut a, mut b) = (
            KvCache::in_arena(arena.clone(), 200),
            KvCache::in_arena(arena.clone(), 200),
        );
        let mut own = KvCache::with_tensor_buffers(placement, 200);
        let rows = |tokens: usize, seed: u64| {
            let kv = crate::compute::linear::test_matrix(2 * 2 * tokens, 8, seed)
                .reshape((2, 1, 2, tokens, 8))
                .unwrap();
            (kv.get(0).unwrap(), kv.get(1).unwrap())
        };
        let (k, v) = rows(40, 1);
        for cache in [&mut a, &mut b, &mut own] {
            cache.append(&k, &v).unwrap();
        }
        assert!(a.extent().is_some() && b.extent().is_some());
        // Past 64 positions `a` needs 128, which the arena (64 of its 128 held by `b`) cannot give.
        let (k, v) = rows(30, 2);
        a.append(&k, &v).unwrap();
        own.append(&k, &v).unwrap();
        assert!(a.extent().is_none() && a.arena().is_none() && b.extent().is_some());
        let ((ak, av), (ok, ov)) = (a.keys_values().unwrap(), own.keys_values().unwrap());
        assert_eq!(values(&ak), values(&ok));
        assert_eq!(values(&av), values(&ov));
        assert_eq!(a.len(), 70);
    }
}

//! One block's keys and values for many sessions in one device tensor, each session's cache an extent of it.
//!
//! On a GPU every candle op is a kernel launch with host work around it, and ops act on one tensor. With a tensor
//! per session, a batch of 16 sessions' one-token steps paid two launches per session and block only to write each
//! session's new key and value and to lay all their keys end to end for the batched attention
//! ([`super::decode_attention`]): 32 of a block's ~60 launches. With every session's cache in one arena, those are
//! one scatter (the writes) and one gather (the reads), whatever the number of sessions.
//!
//! The arena is `[2, kv_heads, capacity, head_dim]` (keys, then values); a session owns a range of positions in it
//! (an [`Extent`]), so its cache is a view (`narrow` on the position axis) exactly as its own buffer was, and a
//! lone session's step costs what it did. An extent grows as a session's own buffer did (doubling, never past the
//! session's reservation): a larger extent is taken and the positions held are copied into it.
//!
//! A node's arena is its KV budget (`--cache-tokens` positions, the memory it planned for when it chose how many
//! blocks fit): allocated whole with the first extent, never grown, so neither a growth's copy nor a doubling can
//! take the device past that plan. A cache that finds no free range there (the budget's positions are admitted,
//! but a range may be cut up) takes tensors of its own instead. Without a budget (a local run) the arena doubles
//! when no free range fits, copying itself once; extents keep their positions. When the last extent is released
//! the arena frees its memory, so an idle node holds no cache.
use crate::compute::placement::Placement;
use crate::error::{ModelError, Result};
use candle_core::Tensor;
use std::sync::{Arc, Mutex, MutexGuard};

/// The arena of one block's caches of one placement (device and KV dtype).
#[derive(Debug)]
pub struct KvArena {
    placement: Placement,
    kv_heads: usize,
    head_dim: usize,
    /// The positions it holds when bounded (a node's budget): allocated at once, never more.
    budget: Option<usize>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// `[2, kv_heads, capacity, head_dim]`; `None` while no extent is held.
    storage: Option<Tensor>,
    capacity: usize,
    /// Ranges of positions no extent holds, `(start, len)`, sorted by start, never adjacent.
    free: Vec<(usize, usize)>,
}

/// A range of positions of an arena held by one session's cache; released when dropped.
#[derive(Debug)]
pub(crate) struct Extent {
    arena: Arc<KvArena>,
    start: usize,
    capacity: usize,
}

impl KvArena {
    /// An empty arena; `budget`: the positions it may hold at most, allocated with the first extent.
    pub fn new(
        placement: Placement,
        kv_heads: usize,
        head_dim: usize,
        budget: Option<usize>,
    ) -> Arc<Self> {
        Arc::new(Self {
            placement,
            kv_heads,
            head_dim,
            budget,
            state: Mutex::default(),
        })
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// `(kv_heads, head_dim)` of the caches it holds.
    pub fn dims(&self) -> (usize, usize) {
        (self.kv_heads, self.head_dim)
    }

    /// Positions the arena's memory holds, held by extents or free.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// An extent of `capacity` positions holding what `old` holds in its first `held` positions (a cache growing;
    /// `old` is released when its holder drops it). `None`: a bounded arena has no free range that long.
    pub(crate) fn allocate(
        self: &Arc<Self>,
        capacity: usize,
        old: Option<&Extent>,
        held: usize,
    ) -> Result<Option<Extent>> {
        let mut state = self.lock();
        let start = match state.take(capacity) {
            Some(start) => start,
            None if self.grow(&mut state, capacity)? => state.take(capacity).ok_or_else(|| {
                ModelError::Config("a KV arena grown for an extent has no room for it".into())
            })?,
            None => return Ok(None),
        };
        if let (Some(old), true) = (old, held > 0) {
            // One storage cannot be both the source and the destination of candle's copy: through a temporary.
            let moved = state.storage().and_then(|storage| {
                let moved = storage.narrow(2, old.start, held)?.contiguous()?;
                Ok(storage.slice_set(&moved, 2, start)?)
            });
            if let Err(e) = moved {
                state.release(start, capacity);
                return Err(e);
            }
        }
        Ok(Some(Extent {
            arena: self.clone(),
            start,
            capacity,
        }))
    }

    /// Writes `src` into the arena at `ids` along the position axis (candle's `scatter_set`: `src` and `ids` of
    /// one shape, `[2, kv_heads, n, head_dim]`). Under the lock, so that no write lands in storage the arena has
    /// just copied away from.
    pub(crate) fn scatter(&self, ids: &Tensor, src: &Tensor) -> Result<()> {
        self.lock().storage()?.scatter_set(ids, src, 2)?;
        Ok(())
    }

    /// The positions `ids` of the arena, `[2, kv_heads, ids, head_dim]`.
    pub(crate) fn gather(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(self.lock().storage()?.index_select(ids, 2)?)
    }

    /// Makes room for an extent of `needed` positions: a bounded arena's memory is allocated whole, once; an
    /// unbounded one at least doubles, what it holds copied over. `false`: a bounded arena can make no room.
    fn grow(&self, state: &mut State, needed: usize) -> Result<bool> {
        // A free range at the end is extended, not left beside the new one.
        let tail = match state.free.last() {
            Some(&(start, len)) if start + len == state.capacity => len,
            _ => 0,
        };
        let capacity = match self.budget {
            Some(budget) if state.capacity == 0 && needed <= budget => budget,
            Some(_) => return Ok(false),
            None => (state.capacity * 2).max(state.capacity + needed - tail),
        };
        let p = &self.placement;
        let grown = Tensor::zeros(
            (2, self.kv_heads, capacity, self.head_dim),
            p.dtype,
            &p.device,
        )?;
        if let Some(old) = &state.storage {
            grown.slice_set(old, 2, 0)?;
        }
        let old = state.capacity;
        state.storage = Some(grown);
        state.capacity = capacity;
        state.add_free(old, capacity - old);
        Ok(true)
    }
}

impl State {
    fn storage(&self) -> Result<&Tensor> {
        self.storage
            .as_ref()
            .ok_or_else(|| ModelError::Config("a KV arena with no storage holds an extent".into()))
    }

    /// The start of `len` free positions (first fit), now held.
    fn take(&mut self, len: usize) -> Option<usize> {
        let i = self.free.iter().position(|&(_, free)| free >= len)?;
        let (start, free) = self.free[i];
        if free == len {
            self.free.remove(i);
        } else {
            self.free[i] = (start + len, free - len);
        }
        Some(start)
    }

    /// Returns `start..start + len` to the free ranges; the memory goes when every position is free.
    fn release(&mut self, start: usize, len: usize) {
        self.add_free(start, len);
        if self.free.first() == Some(&(0, self.capacity)) {
            *self = State::default();
        }
    }

    /// Adds `start..start + len` to the free ranges, merged with its neighbours.
    fn add_free(&mut self, start: usize, len: usize) {
        let i = self.free.partition_point(|&(s, _)| s < start);
        self.free.insert(i, (start, len));
        if i + 1 < self.free.len() && start + len == self.free[i + 1].0 {
            self.free[i].1 += self.free.remove(i + 1).1;
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == start {
            self.free[i - 1].1 += self.free.remove(i).1;
        }
    }
}

impl Extent {
    pub fn arena(&self) -> &Arc<KvArena> {
        &self.arena
    }

    /// The arena position of the extent's first.
    pub fn start(&self) -> usize {
        self.start
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The extent's first `len` positions, `[2, kv_heads, len, head_dim]`, a view of the arena.
    pub fn view(&self, len: usize) -> Result<Tensor> {
        Ok(self.arena.lock().storage()?.narrow(2, self.start, len)?)
    }

    /// Writes keys and values (each `[kv_heads, tokens, head_dim]`, contiguous, on the arena's placement) at the
    /// extent's position `at`, under the arena's lock (see [`KvArena::scatter`]).
    pub fn write_halves(&self, k: &Tensor, v: &Tensor, at: usize) -> Result<()> {
        let state = self.arena.lock();
        let storage = state.storage()?;
        storage.get(0)?.slice_set(k, 1, self.start + at)?;
        storage.get(1)?.slice_set(v, 1, self.start + at)?;
        Ok(())
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        self.arena.lock().release(self.start, self.capacity);
    }
}

#[cfg(test)]
mod tests {
    use super::KvArena;
    use crate::compute::placement::Placement;
    use candle_core::{DType, Device, Tensor};

    fn filled(value: f32, tokens: usize) -> Tensor {
        Tensor::full(value, (2, tokens, 4), &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Extents are disjoint, keep what they hold across their own growth and the arena's, reuse released ranges,
    /// and the arena's memory goes with the last of them.
    #[test]
    fn extents_keep_their_positions_as_the_arena_grows_and_frees() {
        let arena = KvArena::new(Placement::new(Device::Cpu, DType::F32), 2, 4, None);
        let take = |n: usize| arena.allocate(n, None, 0).unwrap().unwrap();
        let a = take(4);
        let b = take(4);
        assert_eq!((a.start(), b.start()), (0, 4));
        a.write_halves(&filled(1.0, 3), &filled(1.0, 3), 0).unwrap();
        b.write_halves(&filled(2.0, 4), &filled(2.0, 4), 0).unwrap();
        // `a` grows past the arena's end: the arena doubles, `a` moves, `b` stays.
        let grown = arena.allocate(8, Some(&a), 3).unwrap().unwrap();
        drop(a);
        let a = grown;
        assert_eq!(a.start(), 8);
        assert!(arena.capacity() >= 16);
        assert_eq!(values(&a.view(3).unwrap()), vec![1.0; 2 * 2 * 3 * 4]);
        assert_eq!(values(&b.view(4).unwrap()), vec![2.0; 2 * 2 * 4 * 4]);
        // `a`'s old range is free again and taken first.
        let c = take(4);
        assert_eq!(c.start(), 0);
        drop(b);
        // Released ranges merge: `c`'s and `b`'s old ones make room for 8 before `a`.
        drop(c);
        let d = take(8);
        assert_eq!(d.start(), 0);
        drop(d);
        drop(a);
        assert_eq!(arena.capacity(), 0);
        assert!(arena.lock().storage.is_none());
    }

    /// A bounded arena takes its whole budget with its first extent and never grows: what does not fit is refused
    /// (`None`), what is released is taken again, and the memory goes with the last extent.
    #[test]
    fn a_bounded_arena_holds_its_budget_and_no_more() {
        let arena = KvArena::new(Placement::new(Device::Cpu, DType::F16), 2, 4, Some(16));
        assert!(arena.allocate(32, None, 0).unwrap().is_none());
        assert_eq!(arena.capacity(), 0);
        let a = arena.allocate(8, None, 0).unwrap().unwrap();
        assert_eq!(arena.capacity(), 16);
        let b = arena.allocate(8, None, 0).unwrap().unwrap();
        assert!(arena.allocate(1, None, 0).unwrap().is_none());
        assert!(arena.allocate(16, Some(&a), 0).unwrap().is_none());
        drop(a);
        let c = arena.allocate(8, None, 0).unwrap().unwrap();
        assert_eq!((c.start(), arena.capacity()), (0, 16));
        drop((b, c));
        assert_eq!(arena.capacity(), 0);
    }
}

//! One attention call for the one-token steps of several sessions whose caches share a block's arena (a GPU's).
//!
//! On a GPU each candle op is a kernel launch with host work around it, and a decode step's arithmetic is small:
//! one session's attention through candle's ops costs about fourteen launches per block (views, two RoPEs, dtype
//! casts, the cache's writes, scores, softmax, the weighted sum), so 16 sessions batched into one step paid 16
//! times that while the matmuls they share paid once (on an H200, 16 sessions' step spent 89–91 ms in the
//! blocks, a lone one 10–11 ms). Here the sessions' queries and keys are rotated together, every session's new
//! key and value written into the block's [`super::kv_arena::KvArena`] with one scatter, the keys each query may
//! see (its own session's, within its window) gathered from the arena end to end with one gather, and every query
//! scored against all of them at once with a mask that keeps it to its own session's: about thirty launches a
//! block whatever the number of sessions. The masked scores are exactly zero after the softmax, so each session's
//! result is its own attention's; only the order in which the device sums differs from a session run alone
//! (tested to f32 rounding).
//!
//! On the CPU this path is not taken: f16 caches there have [`super::host_attention`], and f32 caches keep
//! candle's per-session ops, whose arithmetic is the reference's bit for bit.
use super::attention::{Attention, Projected, SessionRows};
use super::kv_arena::KvArena;
use crate::compute::placement::normalise;
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};
use std::sync::Arc;

/// Whether a step's attention should go through [`attend`]: several sessions on a device other than the CPU.
pub(crate) fn applies(p: &Projected, sessions: &[SessionRows<'_>]) -> bool {
    sessions.len() > 1 && !p.q.device().is_cpu()
}

/// Whether the session's cache takes its buffers from `arena`.
fn in_arena(s: &SessionRows<'_>, arena: &Arc<KvArena>) -> bool {
    s.cache.arena().is_some_and(|a| Arc::ptr_eq(a, arena))
}

/// Every session's attention for a step of one token each: `[1, sessions, heads * head_dim]`, each session's row
/// where its query was. `None` (nothing written) when the step is not of that kind: a session with a prompt or
/// several sequences, rows out of order or not the sessions' alone, caches not all in one arena (or one that left
/// a full arena making room for this step).
pub(crate) fn attend(
    attn: &Attention,
    p: &Projected,
    sessions: &mut [SessionRows<'_>],
) -> Result<Option<Tensor>> {
    let n = sessions.len();
    let Some(arena) = sessions.first().and_then(|s| s.cache.arena()).cloned() else {
        return Ok(None);
    };
    let (kv_heads, d) = (attn.num_kv_heads, attn.head_dim);
    let one_token_each = p.q.dims3()?.1 == n
        && sessions
            .iter()
            .enumerate()
            .all(|(i, s)| s.start == i && s.batch == 1 && s.tokens == 1 && in_arena(s, &arena));
    if !one_token_each || arena.dims() != (kv_heads, d) {
        return Ok(None);
    }
    let placement = arena.placement().clone();
    let group = attn.num_heads / kv_heads;
    // `[1, n, heads * d]` -> `[n, heads, 1, d]`: with one token per session, each session's `[1, heads, 1, d]`.
    let heads = |x: &Tensor, heads: usize| -> Result<Tensor> {
        Ok(x.reshape((n, 1, heads, d))?.transpose(1, 2)?.contiguous()?)
    };
    let (mut q, mut k) = (heads(&p.q, attn.num_heads)?, heads(&p.k, kv_heads)?);
    if let Some([qn, kn]) = &attn.qk_norm {
        q = qn.forward(&q)?;
        k = kn.forward(&k)?;
    }
    let positions: Vec<usize> = sessions.iter().map(|s| s.position).collect();
    let [q, k]: [Tensor; 2] = attn
        .rope
        .apply_each(&[&q, &k], &positions)?
        .try_into()
        .map_err(|_| ModelError::Config("RoPE lost the queries or keys".into()))?;
    let k = normalise(&k, &placement)?;
    let v = normalise(&heads(&p.v, kv_heads)?, &placement)?;
    let device = placement.device.clone();
    // Room for one more position in each session's extent (which may move it, or grow the arena). Then, in one
    // upload: where each session's new key and value go in the arena (`n`), the arena positions of the keys each
    // query sees, every session's end to end (its own, within its window; its query is at `positions[i]`), and
    // which session each of those keys is of.
    for s in sessions.iter_mut() {
        s.cache.host_step((1, kv_heads, d), 1)?;
    }
    // A cache that found no room in a bounded arena now holds tensors of its own: the step goes session by session
    // (room was only reserved; nothing is written yet).
    if !sessions.iter().all(|s| in_arena(s, &arena)) {
        return Ok(None);
    }
    let mut indices = Vec::with_capacity(n);
    let (mut seen, mut owners) = (Vec::new(), Vec::new());
    for (i, s) in sessions.iter().enumerate() {
        let start = s
            .cache
            .extent()
            .ok_or_else(|| ModelError::Config("a KV cache of an arena holds no extent".into()))?
            .start();
        let len = s.cache.len();
        indices.push((start + len) as u32);
        let (first, last) = attn.visible_keys(s.position, 1, len + 1);
        seen.extend((start + first..start + last).map(|t| t as u32));
        owners.extend(std::iter::repeat_n(i as u32, last - first));
    }
    let total = seen.len();
    indices.extend(seen);
    indices.extend(owners);
    let indices = Tensor::from_vec(indices, n + 2 * total, &device)?;

    // `[2, kv_heads, n, d]`: keys, then values, session by session, each written at its session's position.
    let pairs = Tensor::stack(&[&k, &v], 0)?
        .reshape((2, n, kv_heads, d))?
        .transpose(1, 2)?
        .contiguous()?;
    let at = indices
        .narrow(0, 0, n)?
        .reshape((1, 1, n, 1))?
        .broadcast_as((2, kv_heads, n, d))?
        .contiguous()?;
    arena.scatter(&at, &pairs)?;
    sessions.iter_mut().for_each(|s| s.cache.advance(1));
    let all = arena
        .gather(&indices.narrow(0, n, total)?)?
        .to_dtype(DType::F32)?;
    let (keys, values) = (all.get(0)?, all.get(1)?);

    // Queries grouped per KV head: `[kv_heads, n * group, d]`.
    let queries = q
        .to_dtype(DType::F32)?
        .reshape((n, kv_heads, group, d))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((kv_heads, n * group, d))?;
    let scores = (queries.matmul(&keys.t()?)? * attn.scale)?;
    let scores = match attn.softcap {
        Some(cap) => ((scores / cap)?.tanh()? * cap)?,
        None => scores,
    };
    // `[n, total]`, 1 where session `i`'s query sees key `j`: the key is of session `i`.
    let owners = indices.narrow(0, n + total, total)?.reshape((1, total))?;
    let seen = owners.broadcast_eq(&Tensor::arange(0u32, n as u32, &device)?.reshape((n, 1))?)?;
    let shape = (kv_heads, n, group, total);
    let seen = seen.reshape((1, n, 1, total))?.broadcast_as(shape)?;
    let hidden = Tensor::new(f32::NEG_INFINITY, &device)?.broadcast_as(shape)?;
    let scores = seen.where_cond(&scores.reshape(shape)?, &hidden)?;
    let probs = match &attn.sinks {
        // Scores `[kv_heads, n, group, total]`: query head `k * group + g`'s sink for every session.
        Some(sinks) => super::attention::Sinks::softmax(
            &scores,
            &sinks.tensor.reshape((kv_heads, 1, group, 1))?,
        )?,
        None => candle_nn::ops::softmax_last_dim(&scores)?,
    }
    .reshape((kv_heads, n * group, total))?;
    let y = probs
        .matmul(&values)?
        .reshape((kv_heads, n, group, d))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((1, n, attn.num_heads * d))?;
    Ok(Some(y.to_dtype(p.q.dtype())?))
}

#[cfg(test)]
mod tests {
    use super::super::attention::SessionRows;
    use super::super::test_blocks::largest_abs as largest;
    use super::super::{Block, KvArena, KvCache};
    use crate::compute::linear::test_matrix;
    use crate::compute::placement::{test_devices as devices, Placement};
    use candle_core::{DType, Device, Tensor};

    /// Sessions with prompts of `prompts` tokens through `block`'s attention, one after another (candle's ops),
    /// then `decode` steps of one token each: through [`super::attend`] for one copy of the caches (extents of one
    /// arena) and session by session for another (tensors of their own). Outputs agree to f32 rounding, and the
    /// caches are equal.
    fn same_as_each_alone(block: &Block, hidden: usize, prompts: &[usize], decode: usize) {
        // Latent attention (DeepSeek) never takes this path.
        let Some(attn) = block.grouped_attention() else {
            return;
        };
        let device = block.placement().device.clone();
        for kv_dtype in [DType::F32, DType::F16] {
            let placement = Placement::new(device.clone(), kv_dtype);
            let max = prompts.iter().max().unwrap() + decode;
            // Bounded, as a node's: allocated whole with the first extent.
            let arena = KvArena::new(
                placement.clone(),
                attn.num_kv_heads,
                attn.head_dim,
                Some(4096),
            );
            let mut batched: Vec<KvCache> = prompts
                .iter()
                .map(|_| KvCache::in_arena(arena.clone(), max))
                .collect();
            let mut alone: Vec<KvCache> = prompts
                .iter()
                .map(|_| KvCache::with_tensor_buffers(placement.clone(), max))
                .collect();
            let mut seed = 10;
            let mut input = |rows: usize| {
                seed += 1;
                (test_matrix(rows, hidden, seed) * 4.0)
                    .unwrap()
                    .reshape((1, rows, hidden))
                    .unwrap()
                    .to_device(&device)
                    .unwrap()
            };
            for (s, &t) in prompts.iter().enumerate() {
                let p = attn.project(&input(t)).unwrap();
                for caches in [&mut batched, &mut alone] {
                    attn.attend(&p, (0, 1, t), 0, &mut caches[s]).unwrap();
                }
            }
            let mut positions = prompts.to_vec();
            for step in 0..decode {
                let p = attn.project(&input(prompts.len())).unwrap();
                let lens = |caches: &[KvCache]| caches.iter().map(KvCache::len).collect::<Vec<_>>();
                assert_eq!(lens(&batched), lens(&alone));
                let mut sessions: Vec<SessionRows> = batched
                    .iter_mut()
                    .zip(&positions)
                    .enumerate()
                    .map(|(i, (cache, &position))| SessionRows {
                        start: i,
                        batch: 1,
                        tokens: 1,
                        position,
                        cache,
                    })
                    .collect();
                let together = super::attend(attn, &p, &mut sessions)
                    .unwrap()
                    .expect("one-token steps of caches of tensors take the batched path");
                for (i, cache) in alone.iter_mut().enumerate() {
                    let each = attn.attend(&p, (i, 1, 1), positions[i], cache).unwrap();
                    let mine = together.narrow(1, i, 1).unwrap();
                    let diff = largest(
                        &(mine.to_dtype(DType::F32).unwrap() - each.to_dtype(DType::F32).unwrap())
                            .unwrap(),
                    );
                    // The same sums in another order. A unit of rounding in a score of a few hundred moves its
                    // probability by about 3e-5, so the bound is relative, 1e-4 of the largest value; a key of
                    // another session let in, or one of its own left out, moves the result by far more.
                    let bound = 1e-4 * largest(&each).max(1.0);
                    assert!(
                        diff <= bound,
                        "block {}, {device:?}, {kv_dtype:?} cache, step {step}, session {i}: off by {diff} (> {bound})",
                        block.index()
                    );
                }
                positions.iter_mut().for_each(|p| *p += 1);
            }
            for (a, b) in batched.iter().zip(&alone) {
                let (ak, av) = a.snapshot().unwrap();
                let (bk, bv) = b.snapshot().unwrap();
                for (x, y) in [(ak, bk), (av, bv)] {
                    let values = |t: Tensor| {
                        t.to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                    };
                    assert_eq!(
                        values(x),
                        values(y),
                        "the caches hold the same keys and values"
                    );
                }
            }
        }
    }

    fn blocks_of(path: &std::path::Path, device: &Device) -> (Vec<Block>, usize) {
        super::super::test_blocks::blocks_of(path, &Placement::new(device.clone(), DType::F32))
    }

    #[test]
    fn one_token_steps_together_equal_each_alone_on_smollm2() {
        let path = super::super::test_blocks::default_model();
        for device in devices() {
            let (blocks, hidden) = blocks_of(&path, &device);
            same_as_each_alone(&blocks[0], hidden, &[5, 1, 9, 3], 4);
            same_as_each_alone(&blocks[29], hidden, &[300, 2], 3);
        }
    }

    /// Families whose attention differs: QK norms (Qwen3, Gemma 3), softcaps and windows (Gemma 2), windows and a
    /// second RoPE base (Gemma 3), interleaved RoPE, fused projections (Phi-3).
    #[cfg(feature = "synthetic")]
    #[test]
    fn one_token_steps_together_equal_each_alone_for_every_family() {
        for device in devices() {
            let placement = Placement::new(device, DType::F32);
            super::super::test_blocks::for_each_family(&placement, |blocks, hidden| {
                for block in blocks.iter().take(2) {
                    same_as_each_alone(block, hidden, &[6, 1, 3, 9], 6);
                }
            });
        }
    }

    #[test]
    fn steps_of_another_kind_are_left_to_the_other_paths() {
        let path = super::super::test_blocks::default_model();
        let (blocks, hidden) = blocks_of(&path, &Device::Cpu);
        let attn = blocks[0]
            .grouped_attention()
            .expect("a grouped-query block");
        let arena = |dtype| KvArena::new(Placement::new(Device::Cpu, dtype), 3, 64, None);
        let f32_arena = arena(DType::F32);
        let mut caches = [
            KvCache::in_arena(f32_arena.clone(), 8),
            KvCache::in_arena(f32_arena.clone(), 8),
            KvCache::new(Placement::new(Device::Cpu, DType::F16), 8),
        ];
        let lens = |c: &[KvCache]| c.iter().map(KvCache::len).collect::<Vec<_>>();
        let rows = |caches: &mut [KvCache], tokens: &[usize]| -> Option<Tensor> {
            let rows: usize = tokens.iter().sum();
            let p = attn
                .project(
                    &test_matrix(rows, hidden, 1)
                        .reshape((1, rows, hidden))
                        .unwrap(),
                )
                .unwrap();
            let mut start = 0;
            let mut sessions: Vec<SessionRows> = caches
                .iter_mut()
                .zip(tokens)
                .map(|(cache, &tokens)| {
                    let s = SessionRows {
                        start,
                        batch: 1,
                        tokens,
                        position: 0,
                        cache,
                    };
                    start += tokens;
                    s
                })
                .collect();
            super::attend(attn, &p, &mut sessions).unwrap()
        };
        // A prompt among the steps, then a host cache among them: nothing computed, nothing written.
        assert!(rows(&mut caches[..2], &[2, 1]).is_none());
        assert!(rows(&mut caches, &[1, 1, 1]).is_none());
        assert_eq!(lens(&caches), [0, 0, 0]);
        // One-token steps of two caches of one arena: taken.
        assert!(rows(&mut caches[..2], &[1, 1]).is_some());
        assert_eq!(lens(&caches), [1, 1, 0]);
        // Caches of two arenas, or of tensors of their own: left alone.
        for mut other in [
            [
                KvCache::in_arena(f32_arena.clone(), 8),
                KvCache::in_arena(arena(DType::F16), 8),
            ],
            [
                KvCache::with_tensor_buffers(Placement::cpu_f32(), 8),
                KvCache::with_tensor_buffers(Placement::cpu_f32(), 8),
            ],
        ] {
            assert!(rows(&mut other, &[1, 1]).is_none());
            assert_eq!(lens(&other), [0, 0]);
        }
        // A bounded arena with room for one of two caches: the other, making room for this step, takes tensors of
        // its own, and the step is left to the per-session path with nothing written.
        let full = KvArena::new(Placement::cpu_f32(), 3, 64, Some(8));
        let mut crowded = [
            KvCache::in_arena(full.clone(), 8),
            KvCache::in_arena(full.clone(), 8),
        ];
        assert!(rows(&mut crowded, &[1, 1]).is_none());
        assert_eq!(lens(&crowded), [0, 0]);
        assert!(crowded[0].extent().is_some() && crowded[1].arena().is_none());
    }
}

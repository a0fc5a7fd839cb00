//! One attention call for the one-token steps of several sessions whose caches are tensors (a GPU's).
//!
//! On a GPU each candle op is a kernel launch with host work around it, and a decode step's arithmetic is small:
//! one session's attention through candle's ops costs about fourteen launches per block (views, two RoPEs, dtype
//! casts, the cache's writes, scores, softmax, the weighted sum), so 16 sessions batched into one step paid 16
//! times that while the matmuls they share paid once (on an H200, 16 sessions' step spent 89–91 ms in the
//! blocks, a lone one 10–11 ms). Here the sessions' queries and keys are rotated together, each session's new key
//! and value written into its own cache with one copy (a cache of tensors holds both in one buffer), and every
//! query scores the keys of all the sessions at once, laid end to end (one copy per session), with a mask that
//! keeps each query to its own session's keys (and window): two launches per session and about thirty for the
//! step (the same 16 sessions: 26–28 ms). The masked scores are exactly zero after the softmax, so each session's
//! result is its own attention's; only the order in which the device sums differs from a session run alone
//! (tested to f32 rounding).
//!
//! On the CPU this path is not taken: f16 caches there have [`super::host_attention`], and f32 caches keep
//! candle's per-session ops, whose arithmetic is the reference's bit for bit.
use super::attention::{Attention, Projected, SessionRows};
use crate::compute::placement::normalise;
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};

/// Whether a step's attention should go through [`attend`]: several sessions on a device other than the CPU.
pub(crate) fn applies(p: &Projected, sessions: &[SessionRows<'_>]) -> bool {
    sessions.len() > 1 && !p.q.device().is_cpu()
}

/// Every session's attention for a step of one token each: `[1, sessions, heads * head_dim]`, each session's row
/// where its query was. `None` (nothing written) when the step is not of that kind: a session with a prompt or
/// several sequences, rows out of order or not the sessions' alone, caches in host memory or not all on one
/// placement.
pub(crate) fn attend(
    attn: &Attention,
    p: &Projected,
    sessions: &mut [SessionRows<'_>],
) -> Result<Option<Tensor>> {
    let n = sessions.len();
    let one_token_each = p.q.dims3()?.1 == n
        && sessions
            .iter()
            .enumerate()
            .all(|(i, s)| s.start == i && s.batch == 1 && s.tokens == 1 && !s.cache.is_host());
    let Some(first) = sessions.first() else {
        return Ok(None);
    };
    let placement = first.cache.placement().clone();
    let same_placement = |s: &SessionRows<'_>| {
        let c = s.cache.placement();
        c.device.same_device(&placement.device) && c.dtype == placement.dtype
    };
    if !one_token_each || !sessions.iter().all(same_placement) {
        return Ok(None);
    }
    let (kv_heads, d) = (attn.num_kv_heads, attn.head_dim);
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
    // `[n, 2, kv_heads, 1, d]`: each session's key and value side by side, written with one op.
    let pairs = Tensor::stack(&[&k, &v], 1)?;
    for (i, s) in sessions.iter_mut().enumerate() {
        let pair = pairs.narrow(0, i, 1)?.reshape((2, 1, kv_heads, 1, d))?;
        s.cache.append_pair(&pair)?;
    }

    // Every session's keys and values end to end, `[2, 1, kv_heads, keys, d]` (one copy per session), and which of
    // them each query sees: keys `from..to` of the concatenation, session `i`'s own within its window (its query
    // is at `positions[i]`).
    let mut all = Vec::with_capacity(n);
    let (mut from, mut to) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut offset = 0usize;
    for s in sessions.iter() {
        let pair = s
            .cache
            .pair()
            .ok_or_else(|| ModelError::Config("attention over an empty KV cache".into()))?;
        let len = pair.dim(3)?;
        let (first, last) = attn.visible_keys(s.position, 1, len);
        from.push((offset + first) as u32);
        to.push((offset + last) as u32);
        offset += len;
        all.push(pair);
    }
    let all = Tensor::cat(&all, 3)?.to_dtype(DType::F32)?.squeeze(1)?;
    let (keys, values) = (all.get(0)?, all.get(1)?);
    let total = offset;

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
    let device = scores.device();
    let key = Tensor::arange(0u32, total as u32, device)?.reshape((1, total))?;
    let from = Tensor::from_vec(from, (n, 1), device)?;
    let to = Tensor::from_vec(to, (n, 1), device)?;
    // `[n, total]`, 1 where session `i`'s query sees key `j`.
    let seen = (key.broadcast_ge(&from)? * key.broadcast_lt(&to)?)?;
    let shape = (kv_heads, n, group, total);
    let seen = seen.reshape((1, n, 1, total))?.broadcast_as(shape)?;
    let hidden = Tensor::new(f32::NEG_INFINITY, device)?.broadcast_as(shape)?;
    let scores = seen.where_cond(&scores.reshape(shape)?, &hidden)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.reshape((kv_heads, n * group, total))?;
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
    use super::super::{Block, KvCache};
    use crate::compute::linear::test_matrix;
    use crate::compute::placement::{test_devices as devices, Placement};
    use candle_core::{DType, Device, Tensor};

    /// Sessions with prompts of `prompts` tokens through `block`'s attention, one after another (candle's ops),
    /// then `decode` steps of one token each: through [`super::attend`] for one copy of the caches and session by
    /// session for another. Outputs agree to f32 rounding, and the caches are equal.
    fn same_as_each_alone(block: &Block, hidden: usize, prompts: &[usize], decode: usize) {
        let attn = &block.attn;
        let device = block.placement().device.clone();
        for kv_dtype in [DType::F32, DType::F16] {
            let placement = Placement::new(device.clone(), kv_dtype);
            let max = prompts.iter().max().unwrap() + decode;
            let new = || -> Vec<KvCache> {
                prompts
                    .iter()
                    .map(|_| KvCache::with_tensor_buffers(placement.clone(), max))
                    .collect()
            };
            let (mut batched, mut alone) = (new(), new());
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
        let attn = &blocks[0].attn;
        let f32_cpu = Placement::cpu_f32();
        let f16_cpu = Placement::new(Device::Cpu, DType::F16);
        let mut caches = [
            KvCache::with_tensor_buffers(f32_cpu.clone(), 8),
            KvCache::with_tensor_buffers(f32_cpu.clone(), 8),
            KvCache::new(f16_cpu, 8),
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
        // One-token steps of two f32 caches of tensors: taken.
        assert!(rows(&mut caches[..2], &[1, 1]).is_some());
        assert_eq!(lens(&caches), [1, 1, 0]);
        // Caches of two placements: left alone.
        let mut mixed = [
            KvCache::with_tensor_buffers(Placement::cpu_f32(), 8),
            KvCache::with_tensor_buffers(Placement::new(Device::Cpu, DType::F16), 8),
        ];
        assert!(rows(&mut mixed, &[1, 1]).is_none());
    }
}

//! Attention for every session of a batched step at once, on the CPU, against f16 caches in host memory
//! ([`KvCache`]'s host buffers): each session's RoPE, cache write and flash attention in one task, and the
//! sessions' tasks in one parallel region.
//!
//! Through candle ops a session cost about fifteen ops per block (views, copies, two RoPEs, dtype conversions, the
//! cache's writes, the attention), each allocating, and the sessions ran one after another on one thread: 16
//! sessions on a 30-block span were 480 such sequences per step while the other cores waited. Here a session's
//! rows are read from the projections in place, rotated straight into the layout the kernel takes, and its keys
//! and values converted straight into the cache. The arithmetic is the candle path's, so the results are the same
//! bit for bit (tested against it).
use super::attention::{Attention, Projected, SessionRows};
use super::flash_attention::Cache;
use super::rope::HostRope;
use crate::compute::rms_norm::RmsNorm;
use crate::error::{ModelError, Result};
use candle_core::{CpuStorage, Device, Layout, Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// `[1, rows, width]` f32 rows read in place (a view with any row stride, such as one part of a stacked matmul's
/// output).
struct Rows<'a> {
    data: &'a [f32],
    offset: usize,
    stride: usize,
    width: usize,
}

impl Rows<'_> {
    fn row(&self, r: usize) -> &[f32] {
        let at = self.offset + r * self.stride;
        &self.data[at..at + self.width]
    }
}

/// The rows of `t`'s storage, when they are f32 on the CPU, `[1, rows, width]` with contiguous rows, and within
/// the storage.
fn rows<'a>(s: &'a Storage, l: &Layout) -> Option<Rows<'a>> {
    let Storage::Cpu(CpuStorage::F32(data)) = s else {
        return None;
    };
    let (&[1, rows, width], &[_, stride, 1]) = (l.dims(), l.stride()) else {
        return None;
    };
    let view = Rows {
        data,
        offset: l.start_offset(),
        stride,
        width,
    };
    let end = view.offset + rows.saturating_sub(1) * stride + width;
    (rows == 0 || end <= data.len()).then_some(view)
}

/// Every session's attention through host caches: `[1, rows, heads * head_dim]`, each session's rows where its
/// queries were. `None` (nothing written) when this path does not apply: a cache of tensors, projections or RoPE
/// tables that are not f32 on the CPU, or sessions whose rows are not consecutive from the first.
pub(crate) fn attend(
    attn: &Attention,
    p: &Projected,
    sessions: &mut [SessionRows<'_>],
) -> Result<Option<Tensor>> {
    let mut next = 0;
    for s in sessions.iter() {
        if !s.cache.is_host() || s.start != next {
            return Ok(None);
        }
        next += s.batch * s.tokens;
    }
    let (heads, kv_heads, d) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
    let (q, k) = match &attn.qk_norm {
        // Per head, over all rows at once: each row is normalised on its own, as per session.
        Some([qn, kn]) => (
            per_head(qn, &p.q, heads, d)?,
            per_head(kn, &p.k, kv_heads, d)?,
        ),
        None => (p.q.clone(), p.k.clone()),
    };
    let Some(rope) = attn.rope.host() else {
        return Ok(None);
    };
    let ((qs, ql), (ks, kl), (vs, vl)) = (
        q.storage_and_layout(),
        k.storage_and_layout(),
        p.v.storage_and_layout(),
    );
    let (Some(q), Some(k), Some(v)) = (rows(&qs, ql), rows(&ks, kl), rows(&vs, vl)) else {
        return Ok(None);
    };
    let total = ql.dims()[1];
    if next != total || q.width != heads * d || (k.width, v.width) != (kv_heads * d, kv_heads * d) {
        return Ok(None);
    }
    let width = heads * d;
    let mut out = vec![0f32; total * width];
    let mut parts = Vec::with_capacity(sessions.len());
    let mut rest = out.as_mut_slice();
    for s in sessions.iter() {
        let (part, tail) = rest.split_at_mut(s.batch * s.tokens * width);
        parts.push(part);
        rest = tail;
    }
    let run =
        |(s, out): (&mut SessionRows<'_>, &mut [f32])| session(attn, &rope, (&q, &k, &v), s, out);
    if sessions.len() > 1 {
        sessions
            .par_iter_mut()
            .zip(parts.into_par_iter())
            .try_for_each(run)?;
    } else {
        sessions.iter_mut().zip(parts).try_for_each(run)?;
    }
    Ok(Some(Tensor::from_vec(
        out,
        (1, total, width),
        &Device::Cpu,
    )?))
}

/// `norm` applied to each `head_dim` slice of `x` (`[1, rows, heads * head_dim]`).
fn per_head(norm: &RmsNorm, x: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
    let rows = x.dim(1)?;
    Ok(norm
        .forward(&x.contiguous()?.reshape((rows, heads, d))?)?
        .reshape((1, rows, heads * d))?)
}

/// One session: its keys rotated and its values written into its cache, its queries rotated into the kernel's
/// `[batch, kv_heads, group, tokens, head_dim]` layout, and the attention's rows written to `out` (`[batch x
/// tokens, heads x head_dim]`).
fn session(
    attn: &Attention,
    rope: &HostRope<'_>,
    (q, k, v): (&Rows<'_>, &Rows<'_>, &Rows<'_>),
    s: &mut SessionRows<'_>,
    out: &mut [f32],
) -> Result<()> {
    let (b, t, position) = (s.batch, s.tokens, s.position);
    let (heads, kv_heads, d) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
    if position + t > rope.max_position() {
        return Err(ModelError::TooLong {
            position,
            tokens: t,
            max_length: rope.max_position(),
        });
    }
    let held = s.cache.len();
    let host = s
        .cache
        .host_step((b, kv_heads, d), t)?
        .ok_or_else(|| ModelError::Config("host attention over a cache of tensors".into()))?;
    let mut rotated = vec![0f32; d];
    for bi in 0..b {
        for ti in 0..t {
            let row = s.start + bi * t + ti;
            let (kx, vx) = (k.row(row), v.row(row));
            for h in 0..kv_heads {
                rope.rotate(&kx[h * d..(h + 1) * d], position + ti, &mut rotated);
                let at = host.at(bi, h, held + ti);
                host.k[at..at + d].convert_from_f32_slice(&rotated);
                host.v[at..at + d].convert_from_f32_slice(&vx[h * d..(h + 1) * d]);
            }
        }
    }
    s.cache.advance(t);
    let len = held + t;
    if len < position + t {
        return Err(ModelError::Config(format!(
            "attention: {len} cached positions for {t} tokens at position {position}"
        )));
    }
    // `[batch, heads, tokens, head_dim]` is `[batch, kv_heads, group, tokens, head_dim]`: heads are grouped in order.
    let mut queries = vec![0f32; b * heads * t * d];
    for bi in 0..b {
        for ti in 0..t {
            let qx = q.row(s.start + bi * t + ti);
            for h in 0..heads {
                let at = ((bi * heads + h) * t + ti) * d;
                rope.rotate(
                    &qx[h * d..(h + 1) * d],
                    position + ti,
                    &mut queries[at..at + d],
                );
            }
        }
    }
    let (host, _) = s
        .cache
        .host()
        .ok_or_else(|| ModelError::Config("host attention over a cache of tensors".into()))?;
    let caches = (
        Cache::host(&host.k, (kv_heads, host.dims.2, d)),
        Cache::host(&host.v, (kv_heads, host.dims.2, d)),
    );
    let op = attn.flash(position);
    let group = op.group;
    let dims = [b, kv_heads, group, t, d];
    if t == 1 {
        // One token: the kernel's layout is already `[batch, heads x head_dim]`.
        op.compute(&queries, dims, caches, len, out);
    } else {
        let mut y = vec![0f32; queries.len()];
        op.compute(&queries, dims, caches, len, &mut y);
        for bi in 0..b {
            for h in 0..heads {
                for ti in 0..t {
                    let from = ((bi * heads + h) * t + ti) * d;
                    let to = ((bi * t + ti) * heads + h) * d;
                    out[to..to + d].copy_from_slice(&y[from..from + d]);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{Block, BlockStep, KvCache};
    use crate::compute::linear::test_matrix;
    use crate::compute::placement::Placement;
    use candle_core::{DType, Tensor};

    /// Steps of several sessions through `block`, batched, with host caches and with f16 caches of tensors (the
    /// candle ops, one session after another): `prompts` tokens each (one sequence; two for the session given
    /// `batch`), then `decode` steps of one token each. Outputs and caches must be equal bit for bit.
    fn same_as_candle_path(
        (block, hidden): (&Block, usize),
        prompts: &[usize],
        batch: (usize, usize),
        decode: usize,
    ) {
        let f16 = Placement::new(candle_core::Device::Cpu, DType::F16);
        let max = prompts.iter().max().unwrap() + decode;
        let mut host: Vec<KvCache> = prompts
            .iter()
            .map(|_| KvCache::new(f16.clone(), max))
            .collect();
        let mut tensors: Vec<KvCache> = prompts
            .iter()
            .map(|_| KvCache::with_tensor_buffers(f16.clone(), max))
            .collect();
        assert!(host.iter().all(KvCache::is_host) && !tensors.iter().any(KvCache::is_host));
        let sequences = |s: usize| if s == batch.0 { batch.1 } else { 1 };
        let mut seed = 1;
        let mut step = |lengths: &[usize],
                        positions: &[usize],
                        host: &mut [KvCache],
                        tensors: &mut [KvCache]| {
            let inputs: Vec<Tensor> = lengths
                .iter()
                .enumerate()
                .map(|(s, &t)| {
                    seed += 1;
                    let b = sequences(s);
                    (test_matrix(b * t, hidden, seed) * 4.0)
                        .unwrap()
                        .reshape((b, t, hidden))
                        .unwrap()
                })
                .collect();
            let run = |caches: &mut [KvCache]| {
                let mut steps: Vec<BlockStep> = caches
                    .iter_mut()
                    .zip(&inputs)
                    .zip(positions)
                    .map(|((cache, x), &position)| BlockStep {
                        hidden: x.clone(),
                        position,
                        cache,
                    })
                    .collect();
                block.forward_batch(&mut steps).unwrap()
            };
            let (a, b) = (run(host), run(tensors));
            for (x, y) in a.iter().zip(&b) {
                let bits = |t: &Tensor| {
                    t.flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(
                    bits(x),
                    bits(y),
                    "block {}, lengths {lengths:?}",
                    block.index()
                );
            }
        };
        let zeros = vec![0; prompts.len()];
        step(prompts, &zeros, &mut host, &mut tensors);
        let mut positions = prompts.to_vec();
        for _ in 0..decode {
            step(&vec![1; prompts.len()], &positions, &mut host, &mut tensors);
            positions.iter_mut().for_each(|p| *p += 1);
        }
        for (h, t) in host.iter().zip(&tensors) {
            let (hk, hv) = h.snapshot().unwrap();
            let (tk, tv) = t.snapshot().unwrap();
            for (x, y) in [(hk, tk), (hv, tv)] {
                assert_eq!(x.dims(), y.dims());
                let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
                assert_eq!(bits(&x), bits(&y));
            }
        }
    }

    /// The model's blocks on the CPU in f32 and its hidden size.
    fn blocks_of(path: &std::path::Path) -> (Vec<Block>, usize) {
        super::super::test_blocks::blocks_of(path, &Placement::cpu_f32())
    }

    #[test]
    fn equals_the_candle_path_bit_for_bit_on_smollm2() {
        let (blocks, hidden) = blocks_of(&super::super::test_blocks::default_model());
        // Prompts of several lengths batched with a lone token, a session of two sequences, and a context long
        // enough for the kernel to spread one session over the threads.
        same_as_candle_path((&blocks[0], hidden), &[5, 1, 9, 3], (2, 2), 4);
        same_as_candle_path((&blocks[29], hidden), &[700, 2], (1, 1), 3);
        same_as_candle_path((&blocks[7], hidden), &[1], (9, 1), 5);
    }

    /// Families whose attention differs: QK norms (Qwen3, Gemma 3), softcaps and windows (Gemma 2), windows and a
    /// second RoPE base (Gemma 3), fused projections (Phi-3).
    #[cfg(feature = "synthetic")]
    #[test]
    fn equals_the_candle_path_bit_for_bit_for_every_family() {
        super::super::test_blocks::for_each_family(&Placement::cpu_f32(), |blocks, hidden| {
            for block in blocks.iter().take(2) {
                same_as_candle_path((block, hidden), &[6, 1, 3], (1, 2), 6);
            }
        });
    }
}

//! One decoder block: pre-norm attention and a pre-norm gated feed-forward (or mixture of experts), each with a
//! residual; the family options ([`crate::compute::family::FamilyOptions`]) add biases, norms, windows and caps.
mod attention;
mod decode_attention;
mod flash_attention;
mod host_attention;
mod kv_arena;
mod kv_cache;
mod latent_attention;
// Only the x86 SwiGLU path uses it.
#[cfg(target_arch = "x86_64")]
mod libm_exp;
mod mlp;
mod moe;
mod rope;
mod swiglu;
#[cfg(test)]
mod test_blocks;

pub use attention::Attention;
use attention::{SessionRows, Sinks};

use kv_arena::KvArena;
pub use kv_cache::KvCache;
pub use latent_attention::{LatentAttention, QueryProjection};
pub use mlp::Mlp;
pub use moe::MixtureOfExperts;
use moe::Routing;
pub use rope::{Rope, RopeParams};

use crate::compute::family::Moe;
use crate::compute::linear::{Linear, Stacked};
use crate::compute::placement::{normalise, Placement};
use crate::compute::rms_norm::RmsNorm;
use crate::compute::spec::ModelSpec;
use crate::compute::weights::{BlockTensor, Weight, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};
use std::sync::{Arc, Mutex};

/// The block's self-attention: grouped-query, or latent (DeepSeek).
#[derive(Debug, Clone)]
pub enum SelfAttention {
    Grouped(Attention),
    Latent(LatentAttention),
}

impl SelfAttention {
    /// The KV heads of this block's cache and the width of each of its two halves.
    fn cache_shape(&self) -> (usize, usize) {
        match self {
            Self::Grouped(a) => (a.num_kv_heads, a.head_dim),
            Self::Latent(a) => a.cache_shape(),
        }
    }

    /// Attention over `x` (normed rows of every session in `sessions`), through the output projection.
    fn forward(&self, x: &Tensor, sessions: &mut [SessionRows<'_>]) -> Result<Tensor> {
        match self {
            Self::Grouped(a) => {
                let projected = a.project(x)?;
                a.output(&a.attend_all(&projected, sessions)?)
            }
            Self::Latent(a) => a.forward(x, sessions),
        }
    }
}

/// The block's feed-forward: one gated MLP, or a mixture of them.
#[derive(Debug, Clone)]
pub enum FeedForward {
    Mlp(Mlp),
    Experts(MixtureOfExperts),
}

impl FeedForward {
    fn run(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Mlp(m) => m.run(x),
            Self::Experts(m) => m.run(x),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Block {
    index: usize,
    placement: Placement,
    attn_norm: RmsNorm,
    attn: SelfAttention,
    /// Norm of the attention's output before its residual (Gemma).
    post_attn_norm: Option<RmsNorm>,
    ffn_norm: RmsNorm,
    ffn: FeedForward,
    /// Norm of the feed-forward's output before its residual (Gemma).
    post_ffn_norm: Option<RmsNorm>,
    /// The arenas of this block's caches on a GPU, one per KV dtype, made as sessions first ask.
    arenas: Arc<Mutex<Vec<Arc<KvArena>>>>,
}

impl Block {
    /// Loads block `index` onto `placement`. `rope` must have been built for the same placement and for this
    /// layer ([`Rope::for_layer`]).
    pub fn load(
        source: &dyn WeightSource,
        spec: &ModelSpec,
        index: usize,
        placement: Placement,
        rope: Rope,
    ) -> Result<Self> {
        let p = &placement;
        let o = &spec.options;
        let (h, q_dim, kv_dim, ff, hd) = (
            spec.hidden_size,
            spec.num_heads * spec.head_dim,
            spec.kv_dim(),
            spec.intermediate_size,
            spec.head_dim,
        );
        let get = |t: BlockTensor, expected: &[usize]| -> Result<Weight> {
            let w = source.load_block(index, t, &p.device)?;
            if w.dims() != expected {
                return Err(ModelError::TensorShape {
                    name: format!("block {index} {t:?}"),
                    expected: expected.to_vec(),
                    actual: w.dims(),
                });
            }
            Ok(w)
        };
        let norm = |t: BlockTensor, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm::new(
                get(t, &[dim])?.norm(p, o.norm_plus_one)?,
                spec.rms_eps,
            ))
        };
        let matmul = |t: BlockTensor, out: usize, inp: usize| -> Result<Linear> {
            get(t, &[out, inp])?.matmul(p)
        };
        let attn = match &o.latent_attention {
            Some(l) => {
                let heads = spec.num_heads;
                let q_out = heads * l.query_dim();
                let q = match l.q_rank {
                    Some(r) => QueryProjection::LowRank {
                        down: matmul(BlockTensor::QDown, r, h)?,
                        norm: norm(BlockTensor::QDownNorm, r)?,
                        up: matmul(BlockTensor::QUp, q_out, r)?,
                    },
                    None => QueryProjection::Full(matmul(BlockTensor::Q, q_out, h)?),
                };
                let (key_up, value_up) = match get(
                    BlockTensor::KvUp,
                    &[heads * (l.nope_dim + l.value_dim), l.kv_rank],
                ) {
                    Ok(kv_up) => LatentAttention::split_expansion(
                        &kv_up.dense(p)?,
                        heads,
                        l.nope_dim,
                        l.value_dim,
                    )?,
                    // llama.cpp's MLA files hold the two halves, the key's transposed.
                    Err(ModelError::MissingTensor { .. }) => (
                        get(BlockTensor::KeyUp, &[heads, l.kv_rank, l.nope_dim])?
                            .dense(p)?
                            .transpose(1, 2)?
                            .contiguous()?,
                        get(BlockTensor::ValueUp, &[heads, l.value_dim, l.kv_rank])?.dense(p)?,
                    ),
                    Err(e) => return Err(e),
                };
                // YaRN's temperature, squared, on top of 1/sqrt(query width).
                let mscale = o.yarn.map_or(1.0, |y| y.get_mscale(y.mscale_all_dim)) as f64;
                SelfAttention::Latent(LatentAttention {
                    q,
                    kv_down: matmul(BlockTensor::KvDown, l.latent_dim(), h)?,
                    kv_norm: norm(BlockTensor::KvDownNorm, l.kv_rank)?,
                    key_up,
                    value_up,
                    o: matmul(BlockTensor::O, h, heads * l.value_dim)?,
                    num_heads: heads,
                    kv_rank: l.kv_rank,
                    nope_dim: l.nope_dim,
                    rope_dim: l.rope_dim,
                    value_dim: l.value_dim,
                    scale: mscale * mscale / (l.query_dim() as f64).sqrt(),
                    rope,
                })
            }
            None => {
                let qkv = if o.fused_projections {
                    Stacked::split(
                        matmul(BlockTensor::Qkv, q_dim + 2 * kv_dim, h)?,
                        vec![q_dim, kv_dim, kv_dim],
                    )
                } else {
                    Stacked::new(vec![
                        matmul(BlockTensor::Q, q_dim, h)?,
                        matmul(BlockTensor::K, kv_dim, h)?,
                        matmul(BlockTensor::V, kv_dim, h)?,
                    ])?
                };
                let qkv_bias = if o.qkv_bias {
                    let bias = |t: BlockTensor, n: usize| get(t, &[n])?.dense(p);
                    Some([
                        bias(BlockTensor::QBias, q_dim)?,
                        bias(BlockTensor::KBias, kv_dim)?,
                        bias(BlockTensor::VBias, kv_dim)?,
                    ])
                } else {
                    None
                };
                let qk_norm = if o.qk_norm {
                    Some([norm(BlockTensor::QNorm, hd)?, norm(BlockTensor::KNorm, hd)?])
                } else {
                    None
                };
                SelfAttention::Grouped(Attention {
                    qkv,
                    qkv_bias,
                    qk_norm,
                    o: matmul(BlockTensor::O, h, q_dim)?,
                    o_bias: o
                        .output_bias
                        .then(|| get(BlockTensor::OBias, &[h])?.dense(p))
                        .transpose()?,
                    sinks: o
                        .attention_sinks
                        .then(|| Sinks::new(&get(BlockTensor::Sinks, &[spec.num_heads])?.dense(p)?))
                        .transpose()?,
                    num_heads: spec.num_heads,
                    num_kv_heads: spec.num_kv_heads,
                    head_dim: spec.head_dim,
                    scale: 1.0 / o.query_pre_attn_scalar.unwrap_or(hd as f64).sqrt(),
                    softcap: o.attn_softcap,
                    window: spec.window(index),
                    rope,
                })
            }
        };
        let mlp = |[gate, up, down]: [BlockTensor; 3], ff: usize| -> Result<Mlp> {
            Ok(Mlp {
                gate_up: Stacked::new(vec![matmul(gate, ff, h)?, matmul(up, ff, h)?])?,
                down: matmul(down, h, ff)?,
                activation: o.activation,
                biases: None,
            })
        };
        // gpt-oss's experts, with a bias on each projection.
        let expert = |e: usize, m: &Moe| -> Result<Mlp> {
            use BlockTensor::{ExpertDown, ExpertDownBias, ExpertGate, ExpertGateBias};
            use BlockTensor::{ExpertUp, ExpertUpBias};
            let mut mlp = mlp([ExpertGate(e), ExpertUp(e), ExpertDown(e)], m.expert_size)?;
            if m.biases {
                let bias = |t: BlockTensor, n: usize| get(t, &[n])?.dense(p);
                mlp.biases = Some([
                    bias(ExpertGateBias(e), m.expert_size)?,
                    bias(ExpertUpBias(e), m.expert_size)?,
                    bias(ExpertDownBias(e), h)?,
                ]);
            }
            Ok(mlp)
        };
        let sparse = o.moe.as_ref().filter(|m| m.is_sparse(index));
        let ffn = match (sparse, o.fused_projections) {
            (Some(m), _) => FeedForward::Experts(MixtureOfExperts {
                router: matmul(BlockTensor::Router, m.num_experts, h)?,
                router_bias: m
                    .biases
                    .then(|| get(BlockTensor::RouterBias, &[m.num_experts])?.dense(p))
                    .transpose()?,
                experts: (0..m.num_experts)
                    .map(|e| expert(e, m))
                    .collect::<Result<_>>()?,
                routing: Routing {
                    experts_per_token: m.experts_per_token,
                    scoring: m.scoring,
                    normalize_top_k: m.normalize_top_k,
                    groups: m.groups,
                    choice_bias: if m.choice_bias {
                        let bias = get(BlockTensor::ChoiceBias, &[m.num_experts])?.dense(p)?;
                        Some(bias.to_dtype(DType::F32)?.to_vec1::<f32>()?)
                    } else {
                        None
                    },
                    routed_scale: m.routed_scale,
                },
                shared: m
                    .shared_size
                    .map(|size| {
                        use BlockTensor::{SharedDown, SharedGate, SharedUp};
                        mlp([SharedGate, SharedUp, SharedDown], size)
                    })
                    .transpose()?,
            }),
            (None, true) => FeedForward::Mlp(Mlp {
                gate_up: Stacked::split(matmul(BlockTensor::GateUp, 2 * ff, h)?, vec![ff, ff]),
                down: matmul(BlockTensor::Down, h, ff)?,
                activation: o.activation,
                biases: None,
            }),
            (None, false) => FeedForward::Mlp(mlp(
                [BlockTensor::Gate, BlockTensor::Up, BlockTensor::Down],
                ff,
            )?),
        };
        let sandwich = |t: BlockTensor| -> Result<Option<RmsNorm>> {
            o.sandwich_norms.then(|| norm(t, h)).transpose()
        };
        Ok(Self {
            index,
            attn_norm: norm(BlockTensor::AttnNorm, h)?,
            attn,
            post_attn_norm: sandwich(BlockTensor::PostAttnNorm)?,
            ffn_norm: norm(BlockTensor::FfnNorm, h)?,
            ffn,
            post_ffn_norm: sandwich(BlockTensor::PostFfnNorm)?,
            placement,
            arenas: Arc::default(),
        })
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The grouped-query attention, for tests of its kernels.
    #[cfg(test)]
    pub(crate) fn grouped_attention(&self) -> Option<&Attention> {
        match &self.attn {
            SelfAttention::Grouped(a) => Some(a),
            SelfAttention::Latent(_) => None,
        }
    }

    /// A fresh, empty KV cache on this block's device, in `kv_dtype` (default: the block's compute dtype), for at
    /// most `max_length` positions. On a GPU it takes its buffers from the block's arena of that dtype, which all
    /// its sessions share; `kv_budget` bounds the arena (positions) when this call makes it.
    pub fn new_cache(
        &self,
        max_length: usize,
        kv_dtype: Option<DType>,
        kv_budget: Option<usize>,
    ) -> KvCache {
        let placement = Placement::new(
            self.placement.device.clone(),
            kv_dtype.unwrap_or(self.placement.dtype),
        );
        if placement.device.is_cpu() {
            return KvCache::new(placement, max_length);
        }
        let mut arenas = self
            .arenas
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let arena = match arenas
            .iter()
            .find(|a| a.placement().dtype == placement.dtype)
        {
            Some(arena) => arena.clone(),
            None => {
                let (heads, dim) = self.attn.cache_shape();
                let arena = KvArena::new(placement, heads, dim, kv_budget);
                arenas.push(arena.clone());
                arena
            }
        };
        KvCache::in_arena(arena, max_length)
    }

    /// `x`: `[batch, tokens, hidden]` for positions `position..position + tokens`. The input is normalised to this
    /// block's placement first: this is the block boundary where devices and dtypes may change.
    pub fn forward(&self, x: &Tensor, position: usize, cache: &mut KvCache) -> Result<Tensor> {
        let mut out = self.forward_batch(&mut [BlockStep {
            hidden: x.clone(),
            position,
            cache,
        }])?;
        Ok(out.remove(0))
    }

    /// Several sessions' steps at once: their rows go through every projection and the MLP as one matrix; RoPE,
    /// the cache and attention are per session. Returns each step's output, in order; a row's result does not
    /// depend on the other rows.
    pub fn forward_batch(&self, steps: &mut [BlockStep<'_>]) -> Result<Vec<Tensor>> {
        let (x, shapes) = join_rows(steps.iter().map(|s| &s.hidden), &self.placement)?;
        let positions: Vec<usize> = steps.iter().map(|s| s.position).collect();
        let caches = steps.iter_mut().map(|s| &mut *s.cache);
        let x = self.forward_rows(&x, &mut session_rows(&shapes, &positions, caches))?;
        split_rows(&x, &shapes)
    }

    /// The rows of several sessions side by side, `[1, rows, hidden]`, each session's where `sessions` says,
    /// through this block: [`Self::forward_batch`] for a caller that keeps the rows together from one block to the
    /// next (a span whose sessions all take all its blocks).
    pub(crate) fn forward_rows(
        &self,
        x: &Tensor,
        sessions: &mut [SessionRows<'_>],
    ) -> Result<Tensor> {
        let _span =
            tracing::trace_span!("block", index = self.index, sessions = sessions.len()).entered();
        let x = normalise(x, &self.placement)?;
        let y = self.attn.forward(&self.attn_norm.forward(&x)?, sessions)?;
        let y = match &self.post_attn_norm {
            Some(n) => n.forward(&y)?,
            None => y,
        };
        let x = (y + &x)?;
        let y = self.ffn.run(&self.ffn_norm.forward(&x)?)?;
        let y = match &self.post_ffn_norm {
            Some(n) => n.forward(&y)?,
            None => y,
        };
        Ok((y + x)?)
    }
}

/// A step's `(batch, tokens, hidden)`.
pub(crate) type StepShape = (usize, usize, usize);

/// Steps' hidden states (`[batch, tokens, hidden]` each) side by side as one `[1, rows, hidden]` sequence on
/// `placement`, the shape a lone step has, so that quantized matmuls take the same kernels batched or not; and
/// each step's shape, for [`split_rows`].
pub(crate) fn join_rows<'t>(
    hidden: impl IntoIterator<Item = &'t Tensor>,
    placement: &Placement,
) -> Result<(Tensor, Vec<StepShape>)> {
    let mut rows = vec![];
    let mut shapes = vec![];
    for x in hidden {
        let (b, t, h) = x.dims3()?;
        rows.push(normalise(x, placement)?.reshape((1, b * t, h))?);
        shapes.push((b, t, h));
    }
    let x = if rows.len() == 1 {
        rows.remove(0)
    } else {
        Tensor::cat(&rows, 1)?
    };
    Ok((x, shapes))
}

/// Each step's rows of `x` ([`join_rows`]'s sequence, or a block's output for it) in its own shape again.
pub(crate) fn split_rows(x: &Tensor, shapes: &[StepShape]) -> Result<Vec<Tensor>> {
    let mut start = 0;
    shapes
        .iter()
        .map(|&(b, t, h)| {
            let out = x.narrow(1, start, b * t)?.reshape((b, t, h))?;
            start += b * t;
            Ok(out)
        })
        .collect()
}

/// Where each step's rows are in [`join_rows`]'s sequence, with its position and its cache for this block.
pub(crate) fn session_rows<'c>(
    shapes: &[StepShape],
    positions: &[usize],
    caches: impl IntoIterator<Item = &'c mut KvCache>,
) -> Vec<SessionRows<'c>> {
    let mut start = 0;
    caches
        .into_iter()
        .zip(shapes)
        .zip(positions)
        .map(|((cache, &(batch, tokens, _)), &position)| {
            let rows = SessionRows {
                start,
                batch,
                tokens,
                position,
                cache,
            };
            start += batch * tokens;
            rows
        })
        .collect()
}

/// One session's step through a block: hidden states `[batch, tokens, hidden]` at `position`, and its cache.
pub struct BlockStep<'a> {
    pub hidden: Tensor,
    pub position: usize,
    pub cache: &'a mut KvCache,
}

/// Bytes of working memory one step through one block needs at its peak, beside the weights and the KV cache: for
/// `batch` sequences of `tokens` new positions over a `context` of positions (those new ones included).
///
/// Attention dominates: f32 scores, their masked copy and the probabilities for at most [`attention::QUERY_CHUNK`]
/// query rows per sequence and head at a time, against the whole context, plus the keys and values widened to f32.
/// The MLP's and projections' activations come next. An estimate for admission, not an allocator's count: it is
/// linear in `context` and grows with `tokens` only up to the query chunk.
pub fn step_working_bytes(spec: &ModelSpec, batch: usize, tokens: usize, context: usize) -> u64 {
    let f32_bytes = 4u64;
    let (b, t, c) = (batch as u64, tokens as u64, context as u64);
    let rows = b * spec.num_heads as u64 * t.min(attention::QUERY_CHUNK as u64);
    let scores = 3 * rows * c * f32_bytes;
    let kv_f32 = 2 * b * (spec.num_kv_heads * spec.head_dim) as u64 * c * f32_bytes;
    let per_token = (4 * spec.hidden_size + 3 * spec.intermediate_size) as u64;
    let activations = b * t * per_token * f32_bytes;
    scores + kv_f32 + activations
}

//! One description of a model, read from a Hugging Face `config.json`, GGUF metadata or a llama2.c header.
//! Everything downstream (blocks, head, router) is built from this, never from format-specific fields.
use crate::compute::family::{
    Activation, ExpertGroups, ExpertScoring, FamilyOptions, LatentAttention, Moe, SlidingWindow,
    Yarn,
};
use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};

/// How RoPE pairs the dimensions of a head. HF checkpoints permute q/k rows for "rotate half"; GGUF and llama2.c
/// keep Meta's original interleaved pairs, so the same weights need the matching rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeStyle {
    /// Pairs (i, i + d/2): Hugging Face Llama layout.
    Half,
    /// Pairs (2i, 2i + 1): Meta / GGUF / llama2.c layout.
    Interleaved,
}

/// Llama 3 frequency scaling (`rope_scaling.rope_type == "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Human-readable name (file or directory stem), used in logs and model ids.
    pub name: String,
    pub architecture: String,
    pub num_blocks: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub rope_style: RopeStyle,
    pub rms_eps: f64,
    /// Longest context the model was trained for; sessions may not exceed it.
    pub max_position: usize,
    pub tie_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// How the family departs from a Llama block. Left out of the serialised spec when Llama's, so Llama models
    /// keep the ids they had before families existed.
    #[serde(default, skip_serializing_if = "FamilyOptions::is_llama")]
    pub options: FamilyOptions,
}

impl ModelSpec {
    /// A `what` layer list names only layers of this model.
    fn layers_inside(&self, what: &str, layers: &[usize]) -> Result<()> {
        match layers.iter().find(|&&l| l >= self.num_blocks) {
            Some(l) => Err(ModelError::Config(format!(
                "{what} layer {l} is outside the model's {} layers",
                self.num_blocks
            ))),
            None => Ok(()),
        }
    }

    /// Checks the invariants every block relies on, so a bad config fails at load and not mid-generation.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::Config(m));
        for (what, v) in [
            ("num_blocks", self.num_blocks),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position", self.max_position),
        ] {
            if v == 0 {
                return bad(format!("{what} must be positive"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(format!("rms_norm_eps {} must be positive", self.rms_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta {} must be positive", self.rope_theta));
        }
        let o = &self.options;
        if let Some(w) = &o.sliding_window {
            if w.size == 0 {
                return bad("sliding_window must be positive".into());
            }
            self.layers_inside("windowed", &w.layers)?;
        }
        if let Some(m) = &o.moe {
            if m.num_experts == 0 || m.experts_per_token == 0 || m.experts_per_token > m.num_experts
            {
                return bad(format!(
                    "{} experts per token of {} experts",
                    m.experts_per_token, m.num_experts
                ));
            }
            if m.expert_size == 0 {
                return bad("experts' intermediate size must be positive".into());
            }
            self.layers_inside("dense", &m.dense_layers)?;
            if let Some(g) = m.groups {
                let per_group = m.num_experts / g.count.max(1);
                if g.count == 0
                    || !m.num_experts.is_multiple_of(g.count)
                    || g.chosen == 0
                    || g.chosen > g.count
                    || m.experts_per_token > g.chosen * per_group
                {
                    return bad(format!(
                        "{} experts per token from {} of {} groups of {} experts",
                        m.experts_per_token, g.chosen, g.count, m.num_experts
                    ));
                }
            }
            if !(m.routed_scale.is_finite() && m.routed_scale > 0.0) {
                return bad(format!(
                    "routed_scaling_factor {} must be positive",
                    m.routed_scale
                ));
            }
            if m.shared_size == Some(0) {
                return bad("shared experts' intermediate size must be positive".into());
            }
        }
        if let Some(l) = &o.latent_attention {
            if l.kv_rank == 0 || l.nope_dim == 0 || l.value_dim == 0 || l.q_rank == Some(0) {
                return bad(format!(
                    "latent attention dimensions must be positive: {l:?}"
                ));
            }
            if !l.rope_dim.is_multiple_of(2) || !l.latent_dim().is_multiple_of(2) {
                return bad(format!(
                    "latent attention's rotated dimensions ({}) and latent ({}) must be even",
                    l.rope_dim,
                    l.latent_dim()
                ));
            }
            if self.num_kv_heads != 1 || self.head_dim != l.query_dim() {
                return bad(format!(
                    "latent attention caches one latent for {} query heads of {}: not {} KV heads of {}",
                    self.num_heads,
                    l.query_dim(),
                    self.num_kv_heads,
                    self.head_dim
                ));
            }
        }
        if let Activation::ClampedSwiglu { alpha, limit } = o.activation {
            if !(alpha.is_finite() && limit.is_finite() && limit > 0.0) {
                return bad(format!(
                    "clamped SwiGLU needs a finite alpha and a positive limit: {alpha}, {limit}"
                ));
            }
        }
        if let Some(y) = &o.yarn {
            if !(y.factor.is_finite() && y.factor > 0.0) || y.original_max_position == 0 {
                return bad(format!(
                    "YaRN scaling needs a positive factor and context: {y:?}"
                ));
            }
        }
        for (what, v) in [
            ("query_pre_attn_scalar", o.query_pre_attn_scalar),
            ("attn_logit_softcapping", o.attn_softcap),
            ("final_logit_softcapping", o.final_softcap),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                return bad(format!("{what} must be positive"));
            }
        }
        for (what, v) in [
            ("rope_local_base_freq", o.local_rope_theta),
            ("rope_scaling.factor", o.rope_linear_factor),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                return bad(format!("{what} must be positive"));
            }
        }
        Ok(())
    }

    /// Width of each of the KV cache's two halves per position: keys and values of every KV head, or for latent
    /// attention half the latent (its first half is stored as the "keys", the rest as the "values", so the cache
    /// holds exactly the compressed KV).
    pub fn kv_dim(&self) -> usize {
        match &self.options.latent_attention {
            Some(l) => l.latent_dim() / 2,
            None => self.num_kv_heads * self.head_dim,
        }
    }

    /// Dimensions of a head that RoPE rotates: all of it, or latent attention's rotated part.
    pub fn rope_dim(&self) -> usize {
        match &self.options.latent_attention {
            Some(l) => l.rope_dim,
            None => self.head_dim,
        }
    }

    /// Weights of block `block`'s matrices (norms and biases are negligible): attention, and the MLP, or in a
    /// sparse layer of a mixture of experts every expert's plus the router.
    pub fn block_parameters(&self, block: usize) -> u64 {
        let (h, q, kv) = (
            self.hidden_size as u64,
            (self.num_heads * self.head_dim) as u64,
            self.kv_dim() as u64,
        );
        let ffn = match &self.options.moe {
            Some(m) if m.is_sparse(block) => {
                m.num_experts as u64 * (3 * h * m.expert_size as u64 + h)
                    + 3 * h * m.shared_size.unwrap_or(0) as u64
            }
            _ => 3 * h * self.intermediate_size as u64,
        };
        let attention = match &self.options.latent_attention {
            Some(l) => {
                let heads = self.num_heads as u64;
                let rank = l.kv_rank as u64;
                let query = match l.q_rank {
                    Some(r) => h * r as u64 + r as u64 * q,
                    None => h * q,
                };
                query
                    + h * l.latent_dim() as u64
                    + rank * heads * (l.nope_dim + l.value_dim) as u64
                    + heads * l.value_dim as u64 * h
            }
            None => 2 * h * q + 2 * h * kv,
        };
        attention + ffn
    }

    /// Bytes of KV cache one token takes in one block at `dtype_size` bytes per element.
    pub fn kv_bytes_per_token_per_block(&self, dtype_size: usize) -> usize {
        2 * self.kv_dim() * dtype_size
    }

    /// Parses a Hugging Face `config.json` of a supported family (its `model_type`).
    pub fn from_hf_config(name: &str, json: &str) -> Result<Self> {
        let c: HfConfig = serde_json::from_str(json)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        let arch = c
            .model_type
            .clone()
            .or_else(|| c.architectures.first().cloned())
            .unwrap_or_default();
        let family = match arch.as_str() {
            "llama" | "LlamaForCausalLM" => "llama",
            "mistral" | "MistralForCausalLM" => "mistral",
            "mixtral" | "MixtralForCausalLM" => "mixtral",
            "qwen2" | "Qwen2ForCausalLM" => "qwen2",
            "qwen3" | "Qwen3ForCausalLM" => "qwen3",
            "qwen3_moe" | "Qwen3MoeForCausalLM" => "qwen3_moe",
            "phi3" | "Phi3ForCausalLM" => "phi3",
            "gemma2" | "Gemma2ForCausalLM" => "gemma2",
            "gemma3_text" | "Gemma3ForCausalLM" => "gemma3",
            "deepseek_v2" | "DeepseekV2ForCausalLM" => "deepseek_v2",
            "deepseek_v3" | "DeepseekV3ForCausalLM" => "deepseek_v3",
            "gpt_oss" | "GptOssForCausalLM" => "gpt_oss",
            _ => return Err(ModelError::UnknownArchitecture(arch)),
        };
        let deepseek = family.starts_with("deepseek");
        let gpt_oss = family == "gpt_oss";
        if let Some(q) = &c.quantization_config {
            let method = q.quant_method.as_deref().unwrap_or("unnamed");
            if !(gpt_oss && method == "mxfp4") {
                return Err(ModelError::Config(format!(
                    "quantization_config: {method:?} checkpoints are not supported (gpt-oss's \"mxfp4\" is; \
                     other quantized models load from GGUF)"
                )));
            }
        }
        if deepseek {
            let methods = ["greedy", "group_limited_greedy", "noaux_tc"];
            if let Some(m) = c.topk_method.as_deref().filter(|m| !methods.contains(m)) {
                return Err(ModelError::Config(format!(
                    "topk_method {m:?} is not supported ({methods:?} are)"
                )));
            }
            if let Some(f) = c
                .scoring_func
                .as_deref()
                .filter(|f| !["softmax", "sigmoid"].contains(f))
            {
                return Err(ModelError::Config(format!(
                    "scoring_func {f:?} is not supported (softmax and sigmoid are)"
                )));
            }
        }
        let num_heads = c.num_attention_heads;
        let latent_attention = match (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim) {
            (Some(kv_rank), Some(nope_dim), Some(rope_dim)) if deepseek => Some(LatentAttention {
                q_rank: c.q_lora_rank,
                kv_rank,
                nope_dim,
                rope_dim,
                value_dim: c.v_head_dim.unwrap_or(nope_dim),
            }),
            _ if deepseek => {
                return Err(ModelError::Config(
                    "DeepSeek config.json lacks kv_lora_rank, qk_nope_head_dim or qk_rope_head_dim"
                        .into(),
                ))
            }
            _ => None,
        };
        let head_dim = match (c.head_dim, latent_attention) {
            (_, Some(l)) => l.query_dim(),
            (Some(d), None) => d,
            (None, None) if num_heads > 0 => c.hidden_size / num_heads,
            (None, None) => 0,
        };
        let scaling = c.rope_scaling.as_ref().and_then(|s| {
            s.rope_type
                .as_deref()
                .or(s.kind.as_deref())
                .map(|kind| (kind, s))
        });
        let mut rope_scaling = None;
        let mut rope_linear_factor = None;
        let mut yarn = None;
        match scaling {
            None | Some(("default", _)) => {}
            Some(("yarn", s)) => {
                yarn = Some(Yarn {
                    factor: s.factor.unwrap_or(1.0),
                    original_max_position: s.original_max_position_embeddings.unwrap_or(4096),
                    beta_fast: s.beta_fast.unwrap_or(32.0),
                    beta_slow: s.beta_slow.unwrap_or(1.0),
                    mscale: s.mscale.unwrap_or(1.0),
                    mscale_all_dim: s.mscale_all_dim.unwrap_or(0.0),
                    truncate: s.truncate.unwrap_or(true),
                })
            }
            Some(("llama3", s)) => {
                rope_scaling = Some(Llama3RopeScaling {
                    factor: s.factor.unwrap_or(1.0),
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position_embeddings: s
                        .original_max_position_embeddings
                        .unwrap_or(8192),
                })
            }
            Some(("linear", s)) => rope_linear_factor = s.factor,
            Some((other, _)) => {
                return Err(ModelError::Config(format!(
                    "rope_scaling type {other:?} is not supported (default, linear, llama3 and yarn are)"
                )))
            }
        }
        if c.partial_rotary_factor.is_some_and(|f| f != 1.0) {
            return Err(ModelError::Config(
                "partial_rotary_factor other than 1 is not supported".into(),
            ));
        }
        let act_name = c
            .hidden_activation
            .as_deref()
            .or(c.hidden_act.as_deref())
            .unwrap_or(if family.starts_with("gemma") {
                "gelu_pytorch_tanh"
            } else {
                "silu"
            });
        let activation = match Activation::from_hf(act_name) {
            // gpt-oss names its clamped SwiGLU `silu`; the clamp and its constants are in its code and config.
            Some(Activation::Silu) if gpt_oss => Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: c.swiglu_limit.unwrap_or(7.0),
            },
            Some(a) => a,
            None => {
                return Err(ModelError::Config(format!(
                    "activation {act_name:?} is not supported"
                )))
            }
        };
        let layers = c.num_hidden_layers;
        // Which layers are windowed: an explicit `layer_types` list wins (newer configs); else each family's rule.
        let listed = c.layer_types.as_ref().map(|types| {
            (0..layers)
                .filter(|&i| types.get(i).map(String::as_str) == Some("sliding_attention"))
                .collect::<Vec<_>>()
        });
        let windowed: Vec<usize> = match family {
            _ if listed.is_some() => listed.unwrap_or_default(),
            "mistral" | "mixtral" | "phi3" => (0..layers).collect(),
            "qwen2" | "qwen3" | "qwen3_moe" if c.use_sliding_window.unwrap_or(false) => {
                (c.max_window_layers.unwrap_or(0)..layers).collect()
            }
            "gemma2" | "gpt_oss" => (0..layers).filter(|i| i % 2 == 0).collect(),
            "gemma3" => {
                let n = c.sliding_window_pattern.unwrap_or(6).max(1);
                (0..layers).filter(|i| (i + 1) % n != 0).collect()
            }
            _ => vec![],
        };
        let sliding_window = match c.sliding_window {
            Some(size) if !windowed.is_empty() => Some(SlidingWindow {
                size,
                layers: windowed,
            }),
            _ => None,
        };
        let gemma = family.starts_with("gemma");
        let options = FamilyOptions {
            qkv_bias: family == "qwen2" || c.attention_bias.unwrap_or(false),
            qk_norm: matches!(family, "qwen3" | "qwen3_moe" | "gemma3"),
            norm_plus_one: gemma,
            activation,
            sandwich_norms: gemma,
            scale_embeddings: gemma,
            query_pre_attn_scalar: c.query_pre_attn_scalar.filter(|_| gemma),
            attn_softcap: c.attn_logit_softcapping.filter(|_| gemma),
            final_softcap: c.final_logit_softcapping.filter(|_| gemma),
            sliding_window,
            local_rope_theta: c.rope_local_base_freq.filter(|_| family == "gemma3"),
            rope_linear_factor,
            fused_projections: family == "phi3",
            moe: match family {
                "mixtral" => Some(Moe {
                    num_experts: c.num_local_experts.unwrap_or(8),
                    experts_per_token: c.num_experts_per_tok.unwrap_or(2),
                    normalize_top_k: true,
                    expert_size: c.intermediate_size,
                    ..Moe::default()
                }),
                "qwen3_moe" => {
                    // HF: a layer is sparse unless listed in `mlp_only_layers`, and then only every
                    // `decoder_sparse_step`-th one (counting from 1).
                    let step = c.decoder_sparse_step.unwrap_or(1).max(1);
                    let listed = c.mlp_only_layers.clone().unwrap_or_default();
                    Some(Moe {
                        num_experts: c.num_experts.unwrap_or(128),
                        experts_per_token: c.num_experts_per_tok.unwrap_or(8),
                        normalize_top_k: c.norm_topk_prob.unwrap_or(false),
                        expert_size: c.moe_intermediate_size.unwrap_or(c.intermediate_size),
                        dense_layers: (0..layers)
                            .filter(|l| listed.contains(l) || (l + 1) % step != 0)
                            .collect(),
                        ..Moe::default()
                    })
                }
                // A softmax over the best experts' logits: the same weights as all experts' softmax renormalised.
                "gpt_oss" => Some(Moe {
                    num_experts: c.num_local_experts.unwrap_or(32),
                    experts_per_token: c.num_experts_per_tok.unwrap_or(4),
                    normalize_top_k: true,
                    expert_size: c.intermediate_size,
                    biases: true,
                    ..Moe::default()
                }),
                "deepseek_v2" | "deepseek_v3" => c.n_routed_experts.map(|experts| {
                    // HF: layers before `first_k_dense_replace`, and those off `moe_layer_freq`, are dense.
                    let first_sparse = c.first_k_dense_replace.unwrap_or(0);
                    let freq = c.moe_layer_freq.unwrap_or(1).max(1);
                    let method = c.topk_method.as_deref().unwrap_or("greedy");
                    let normalize_top_k = c.norm_topk_prob.unwrap_or(false);
                    let factor = c.routed_scaling_factor.unwrap_or(1.0);
                    let expert_size = c.moe_intermediate_size.unwrap_or(c.intermediate_size);
                    Moe {
                        num_experts: experts,
                        experts_per_token: c.num_experts_per_tok.unwrap_or(1),
                        normalize_top_k,
                        expert_size,
                        dense_layers: (0..layers)
                            .filter(|&l| l < first_sparse || l % freq != 0)
                            .collect(),
                        scoring: match c.scoring_func.as_deref() {
                            Some("sigmoid") => ExpertScoring::Sigmoid,
                            _ => ExpertScoring::Softmax,
                        },
                        groups: (method != "greedy").then_some(ExpertGroups {
                            count: c.n_group.unwrap_or(1),
                            chosen: c.topk_group.unwrap_or(1),
                        }),
                        choice_bias: method == "noaux_tc",
                        // DeepSeek-V2 scales the weights only when it does not renormalise them; V3 always.
                        routed_scale: if family == "deepseek_v2" && normalize_top_k {
                            1.0
                        } else {
                            factor
                        },
                        shared_size: c.n_shared_experts.map(|n| n * expert_size),
                        ..Moe::default()
                    }
                }),
                _ => None,
            },
            latent_attention,
            yarn,
            attention_sinks: gpt_oss,
            output_bias: gpt_oss,
        };
        let spec = Self {
            name: name.to_string(),
            architecture: family.into(),
            num_blocks: layers,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_heads,
            // Latent attention's cache is one latent shared by every head.
            num_kv_heads: if latent_attention.is_some() {
                1
            } else {
                c.num_key_value_heads.unwrap_or(num_heads)
            },
            head_dim,
            vocab_size: c.vocab_size,
            rope_theta: c.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            // DeepSeek's HF code rotates interleaved pairs.
            rope_style: if deepseek {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Half
            },
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6),
            max_position: c.max_position_embeddings.unwrap_or(4096),
            // Gemma always ties its LM head to the embeddings.
            tie_embeddings: gemma || c.tie_word_embeddings.unwrap_or(false),
            bos_token_id: c.bos_token_id,
            eos_token_ids: match c.eos_token_id {
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
                None => vec![],
            },
            options,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The window of layer `layer`, if it attends over a sliding window.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.options.window(layer)
    }
}

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    vocab_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f32>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    rope_local_base_freq: Option<f32>,
    partial_rotary_factor: Option<f64>,
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    routed_scaling_factor: Option<f32>,
    topk_method: Option<String>,
    scoring_func: Option<String>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    swiglu_limit: Option<f32>,
    quantization_config: Option<HfQuantization>,
}

/// A checkpoint's `quantization_config`: only gpt-oss's MXFP4 experts are read (other methods store tensors this
/// loader would misread, so they are refused at open).
#[derive(Deserialize)]
struct HfQuantization {
    quant_method: Option<String>,
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
    beta_fast: Option<f32>,
    beta_slow: Option<f32>,
    mscale: Option<f32>,
    mscale_all_dim: Option<f32>,
    truncate: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;

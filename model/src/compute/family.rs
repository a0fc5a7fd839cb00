//! What sets the supported families apart, as options of the one block implementation: each is a small change to
//! the Llama block (a bias, a norm, an activation, a window), so no family has a block of its own.
//!
//! | family  | options                                                                                         |
//! |---------|-------------------------------------------------------------------------------------------------|
//! | llama   | none                                                                                            |
//! | mistral | sliding window (all layers) when the config sets one                                            |
//! | mixtral | mistral + mixture of experts                                                                    |
//! | qwen2   | q/k/v biases; sliding window from `max_window_layers` when enabled                              |
//! | qwen3   | q/k RMSNorm per head                                                                            |
//! | qwen3_moe | qwen3 + mixture of experts of their own width, dense layers where the config keeps them        |
//! | phi3    | fused q/k/v and gate/up matrices in the files                                                   |
//! | gemma2  | GeGLU, norms around attention and MLP, 1 + w norms, scaled embeddings, soft-capping, even layers windowed |
//! | gemma3  | gemma2 + q/k norms, every n-th layer global, own RoPE base for windowed layers, linear scaling  |
//! | deepseek_v2 | latent attention (a compressed KV), YaRN, experts with shared ones, dense first layers      |
//! | deepseek_v3 | deepseek_v2 + sigmoid routing with a correction bias, limited to the best groups of experts |
//! | gpt_oss | attention sinks, every other layer windowed, biases everywhere, YaRN, clamped SwiGLU experts        |
use serde::{Deserialize, Serialize};

/// The gating activation of the feed-forward: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU (Llama, Mistral, Qwen, Phi-3).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// GeGLU with the exact erf GELU.
    Gelu,
    /// gpt-oss's SwiGLU: the gate clamped above at `limit`, the up projection to `±limit`, and
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl Activation {
    /// The HF config name (`hidden_act` / `hidden_activation`).
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Self::GeluTanh),
            "gelu" => Some(Self::Gelu),
            _ => None,
        }
    }
}

/// Attention over the last `size` positions only (a key at `j` is seen by the query at `i` iff `i - j < size`), in
/// the listed layers; the others see the whole context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlidingWindow {
    pub size: usize,
    /// Indices of the windowed layers, ascending.
    pub layers: Vec<usize>,
}

/// How the router's logits become each expert's score.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertScoring {
    /// A softmax over all experts (Mixtral, Qwen3-MoE, DeepSeek-V2).
    #[default]
    Softmax,
    /// Each expert's own sigmoid (DeepSeek-V3).
    Sigmoid,
}

/// Group-limited routing: experts are split into `count` equal groups and a token's experts come only from its
/// `chosen` best groups. A group's score is its best expert's (softmax scoring, DeepSeek-V2) or the sum of its
/// best two (sigmoid scoring, DeepSeek-V3, on the bias-corrected scores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertGroups {
    pub count: usize,
    pub chosen: usize,
}

/// A sparse mixture of experts in place of the MLP: a router picks `experts_per_token` of `num_experts` SwiGLU
/// experts per token and mixes their outputs by the router's weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Moe {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Whether the chosen experts' weights are renormalised to sum to 1 (Mixtral, Qwen3-MoE: yes).
    pub normalize_top_k: bool,
    /// Width of each expert's feed-forward (Qwen3-MoE's `moe_intermediate_size`; Mixtral's experts are as wide as
    /// its `intermediate_size`).
    pub expert_size: usize,
    /// Layers that keep a dense MLP of `intermediate_size` instead (Qwen3-MoE's `mlp_only_layers` and
    /// `decoder_sparse_step`, DeepSeek's first `first_k_dense_replace`), ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
    #[serde(default, skip_serializing_if = "is_default")]
    pub scoring: ExpertScoring,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<ExpertGroups>,
    /// The files hold a per-expert bias added to the scores to choose experts (not to weigh them): DeepSeek-V3's
    /// `e_score_correction_bias`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub choice_bias: bool,
    /// The chosen experts' weights are multiplied by this (DeepSeek's `routed_scaling_factor`).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub routed_scale: f32,
    /// Width of the shared experts, which every token goes through besides its chosen ones (DeepSeek's
    /// `n_shared_experts x moe_intermediate_size`, one MLP in the files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_size: Option<usize>,
    /// The router's logits and each expert's three projections have biases (gpt-oss).
    #[serde(default, skip_serializing_if = "is_false")]
    pub biases: bool,
}

/// One expert of one, softmax routing, nothing shared: a base to fill in.
impl Default for Moe {
    fn default() -> Self {
        Self {
            num_experts: 1,
            experts_per_token: 1,
            normalize_top_k: false,
            expert_size: 0,
            dense_layers: vec![],
            scoring: ExpertScoring::Softmax,
            groups: None,
            choice_bias: false,
            routed_scale: 1.0,
            shared_size: None,
            biases: false,
        }
    }
}

impl Moe {
    /// Whether layer `layer` routes to experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.dense_layers.binary_search(&layer).is_err()
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3): keys and values of all heads are expanded from one compressed
/// latent of `kv_rank` values per position plus `rope_dim` rotated key values shared by every head, and that
/// latent is what the KV cache holds. Each head's query is `nope_dim + rope_dim` wide and its value `value_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatentAttention {
    /// Queries come through a low-rank projection of this rank with a norm between (`q_lora_rank`); `None`: one
    /// projection (DeepSeek-V2-Lite).
    pub q_rank: Option<usize>,
    pub kv_rank: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub value_dim: usize,
}

impl LatentAttention {
    /// Values the cache holds per position: the latent and the rotated key.
    pub fn latent_dim(&self) -> usize {
        self.kv_rank + self.rope_dim
    }

    /// Width of a query head (and of a key head as the model defines them).
    pub fn query_dim(&self) -> usize {
        self.nope_dim + self.rope_dim
    }
}

/// YaRN RoPE scaling (`rope_scaling.type == "yarn"`: DeepSeek, gpt-oss): frequencies interpolated by `factor` below
/// a band set by `beta_fast`/`beta_slow` rotations over the original context, the tables scaled by `mscale`'s
/// ratio and the scores by `mscale_all_dim`'s square (HF's default `attention_factor` is `mscale` 1 over
/// `mscale_all_dim` 0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    pub factor: f32,
    pub original_max_position: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub mscale: f32,
    pub mscale_all_dim: f32,
    /// The band's ends are rounded outwards to whole pairs (HF's `truncate`, default true; llama.cpp always does).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub truncate: bool,
}

impl Yarn {
    /// YaRN's attention temperature for a magnitude `m`: `0.1 m ln(factor) + 1` when the context is stretched.
    pub fn get_mscale(&self, m: f32) -> f32 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * m * self.factor.ln() + 1.0
        }
    }
}

/// Every way a supported family departs from a plain Llama block. The default is Llama.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FamilyOptions {
    /// Biases on the query, key and value projections (Qwen2).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// RMSNorm over each head of the queries and keys, before RoPE (Qwen3, Gemma 3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// Norm weights are stored as `w - 1`: norms multiply by `1 + w` (Gemma's HF checkpoints; llama.cpp adds the 1
    /// when it converts them to GGUF).
    #[serde(default, skip_serializing_if = "is_false")]
    pub norm_plus_one: bool,
    #[serde(default, skip_serializing_if = "is_default")]
    pub activation: Activation,
    /// Norms on the attention's and the feed-forward's outputs too, before each residual (Gemma 2/3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub sandwich_norms: bool,
    /// Embeddings multiplied by `sqrt(hidden_size)` (Gemma).
    #[serde(default, skip_serializing_if = "is_false")]
    pub scale_embeddings: bool,
    /// Scores are scaled by `1/sqrt(this)` instead of `1/sqrt(head_dim)` (Gemma's `query_pre_attn_scalar`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// `cap * tanh(scores / cap)` before the softmax (Gemma 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_softcap: Option<f64>,
    /// `cap * tanh(logits / cap)` on the final logits (Gemma 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_softcap: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<SlidingWindow>,
    /// RoPE base of the windowed layers where it differs from the others' (Gemma 3's `rope_local_base_freq`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rope_theta: Option<f32>,
    /// Linear RoPE scaling of the full-attention layers: positions divided by this factor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_linear_factor: Option<f32>,
    /// The files hold q/k/v as one matrix and gate/up as one (Phi-3); the block splits their outputs.
    #[serde(default, skip_serializing_if = "is_false")]
    pub fused_projections: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Moe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latent_attention: Option<LatentAttention>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub yarn: Option<Yarn>,
    /// One learned logit per query head joins every softmax of its scores and takes its share of the weight, with
    /// no value (gpt-oss's `sinks`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub attention_sinks: bool,
    /// A bias on the attention's output projection (gpt-oss, and Llama with `attention_bias`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub output_bias: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_true(b: &bool) -> bool {
    *b
}

fn yes() -> bool {
    true
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

fn one() -> f32 {
    1.0
}

fn is_one(v: &f32) -> bool {
    *v == 1.0
}

impl FamilyOptions {
    /// Whether every option is Llama's.
    pub fn is_llama(&self) -> bool {
        *self == Self::default()
    }

    /// The window of layer `layer`, if it is a windowed one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .as_ref()
            .filter(|w| w.layers.binary_search(&layer).is_ok())
            .map(|w| w.size)
    }
}

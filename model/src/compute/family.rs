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
use serde::{Deserialize, Serialize};

/// The gating activation of the feed-forward: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU (Llama, Mistral, Qwen, Phi-3).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// GeGLU with the exact erf GELU.
    Gelu,
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

/// A sparse mixture of experts in place of the MLP: a router picks `experts_per_token` of `num_experts` SwiGLU
/// experts per token and mixes their outputs by the router's softmax weights.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moe {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Whether the chosen experts' weights are renormalised to sum to 1 (Mixtral, Qwen3-MoE: yes).
    pub normalize_top_k: bool,
    /// Width of each expert's feed-forward (Qwen3-MoE's `moe_intermediate_size`; Mixtral's experts are as wide as
    /// its `intermediate_size`).
    pub expert_size: usize,
    /// Layers that keep a dense MLP of `intermediate_size` instead (Qwen3-MoE's `mlp_only_layers` and
    /// `decoder_sparse_step`), ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
}

impl Moe {
    /// Whether layer `layer` routes to experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.dense_layers.binary_search(&layer).is_err()
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
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
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

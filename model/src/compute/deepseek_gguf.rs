//! DeepSeek-V2/V3 as llama.cpp's converter writes them (`deepseek2`): the latent attention's widths, YaRN, and the
//! routing, from its metadata keys.
//!
//! llama.cpp's MLA files say `head_count_kv = 1` and give the cached widths as `key_length` / `value_length` (the
//! latent plus the rotated key, the latent) and the per-head widths as `key_length_mla` / `value_length_mla`; older
//! files give the per-head widths as `key_length` / `value_length`. YaRN's `mscale_all_dim` is stored as
//! `yarn_log_multiplier / 0.1`; `mscale` is not stored, and llama.cpp takes it equal (as every DeepSeek config has it).
use crate::compute::family::{ExpertGroups, ExpertScoring, LatentAttention, Moe, Yarn};
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;

/// What a `deepseek2` file adds to the common GGUF description.
pub(crate) struct DeepseekOptions {
    pub latent: LatentAttention,
    pub yarn: Option<Yarn>,
    pub moe: Option<Moe>,
}

/// llama.cpp's `expert_gating_func` values.
const GATING_SOFTMAX: u32 = 1;
const GATING_SIGMOID: u32 = 2;

/// `has_tensor` answers for a tensor name; `blocks` and `heads` come from the common keys.
pub(crate) fn deepseek2_options(
    md: &HashMap<String, Value>,
    has_tensor: impl Fn(&str) -> bool,
    blocks: usize,
) -> Result<DeepseekOptions> {
    let get = |key: &str| md.get(&format!("deepseek2.{key}"));
    let u32_of = |key: &str| get(key).and_then(|v| v.to_u32().ok()).map(|v| v as usize);
    let need = |key: &str| {
        u32_of(key)
            .ok_or_else(|| ModelError::Config(format!("GGUF metadata lacks deepseek2.{key}")))
    };
    let f32_of = |key: &str| get(key).and_then(|v| v.to_f32().ok());
    let rope_dim = need("rope.dimension_count")?;
    let kv_rank = need("attention.kv_lora_rank")?;
    let (query_dim, value_dim) = match (
        u32_of("attention.key_length_mla"),
        u32_of("attention.value_length_mla"),
    ) {
        (Some(k), Some(v)) => (k, v),
        _ => (
            need("attention.key_length")?,
            need("attention.value_length")?,
        ),
    };
    let nope_dim = query_dim
        .checked_sub(rope_dim)
        .filter(|&d| d > 0)
        .ok_or_else(|| {
            ModelError::Config(format!(
            "deepseek2: key width {query_dim} leaves nothing beside {rope_dim} rotated dimensions"
        ))
        })?;
    let latent = LatentAttention {
        // DeepSeek-V2-Lite has no low-rank query: its files hold `attn_q` instead.
        q_rank: has_tensor("blk.0.attn_q_a.weight")
            .then(|| need("attention.q_lora_rank"))
            .transpose()?,
        kv_rank,
        nope_dim,
        rope_dim,
        value_dim,
    };
    let scaling = md
        .get("deepseek2.rope.scaling.type")
        .and_then(|v| v.to_string().ok())
        .map(String::as_str);
    let yarn = match scaling {
        Some("yarn") => {
            let mscale_all_dim = f32_of("rope.scaling.yarn_log_multiplier").unwrap_or(0.0) / 0.1;
            Some(Yarn {
                factor: f32_of("rope.scaling.factor").unwrap_or(1.0),
                original_max_position: need("rope.scaling.original_context_length")?,
                beta_fast: f32_of("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
                beta_slow: f32_of("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
                mscale: mscale_all_dim,
                mscale_all_dim,
                truncate: true,
            })
        }
        None | Some("none") => None,
        Some(other) => {
            return Err(ModelError::Config(format!(
                "deepseek2: rope scaling {other:?} is not supported (yarn is)"
            )))
        }
    };
    let experts = u32_of("expert_count").unwrap_or(0);
    let moe = if experts == 0 {
        None
    } else {
        let dense_lead = u32_of("leading_dense_block_count").unwrap_or(0);
        let expert_size = need("expert_feed_forward_length")?;
        let scoring = match u32_of("expert_gating_func").map(|g| g as u32) {
            None | Some(GATING_SOFTMAX) => ExpertScoring::Softmax,
            Some(GATING_SIGMOID) => ExpertScoring::Sigmoid,
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "deepseek2: expert_gating_func {other} is not supported (1 softmax, 2 sigmoid)"
                )))
            }
        };
        let groups = match (
            u32_of("expert_group_count"),
            u32_of("expert_group_used_count"),
        ) {
            (Some(count), Some(chosen)) if count > 1 => Some(ExpertGroups { count, chosen }),
            _ => None,
        };
        let shared = u32_of("expert_shared_count").unwrap_or(0);
        Some(Moe {
            num_experts: experts,
            experts_per_token: need("expert_used_count")?,
            normalize_top_k: get("expert_weights_norm")
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(false),
            expert_size,
            dense_layers: (0..dense_lead.min(blocks)).collect(),
            scoring,
            groups,
            choice_bias: (dense_lead..blocks)
                .next()
                .is_some_and(|b| has_tensor(&format!("blk.{b}.exp_probs_b.bias"))),
            routed_scale: f32_of("expert_weights_scale")
                .filter(|&s| s != 0.0)
                .unwrap_or(1.0),
            shared_size: (shared > 0).then_some(shared * expert_size),
            ..Moe::default()
        })
    };
    Ok(DeepseekOptions { latent, yarn, moe })
}

//! The `deepseek2` metadata a synthetic DeepSeek GGUF carries, as llama.cpp's converter writes it.
use super::{SyntheticShape, WeightDType};
use candle_core::quantized::gguf_file::Value;

/// DeepSeek's keys as llama.cpp's converter writes an MLA file: one KV head of the latent and the cached widths,
/// the per-head widths apart, the routing and YaRN of the shape's HF config. They replace the common keys of the
/// same names.
pub fn deepseek2_metadata(shape: &SyntheticShape) -> Vec<(String, Value)> {
    let k = |key: &str| format!("deepseek2.{key}");
    let u32v = |v: usize| Value::U32(v as u32);
    let (q_rank, kv_rank, nope, rope, value) = shape.latent_dims();
    let c = shape.config_json(WeightDType::F32);
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let count = |v: &serde_json::Value| v.as_u64().unwrap_or(0) as usize;
    let yarn = &c["rope_scaling"];
    let mut metadata = vec![
        (k("attention.head_count_kv"), u32v(1)),
        (k("attention.key_length"), u32v(kv_rank + rope)),
        (k("attention.value_length"), u32v(kv_rank)),
        (k("attention.key_length_mla"), u32v(nope + rope)),
        (k("attention.value_length_mla"), u32v(value)),
        (k("attention.kv_lora_rank"), u32v(kv_rank)),
        (k("rope.dimension_count"), u32v(rope)),
        (
            k("leading_dense_block_count"),
            u32v(count(&c["first_k_dense_replace"])),
        ),
        (
            k("expert_shared_count"),
            u32v(count(&c["n_shared_experts"])),
        ),
        (
            k("expert_weights_scale"),
            Value::F32(num(&c["routed_scaling_factor"]) as f32),
        ),
        (
            k("expert_weights_norm"),
            Value::Bool(c["norm_topk_prob"].as_bool().unwrap_or(false)),
        ),
        (
            k("expert_gating_func"),
            u32v(if c["scoring_func"] == "sigmoid" { 2 } else { 1 }),
        ),
        (k("expert_group_count"), u32v(count(&c["n_group"]))),
        (k("expert_group_used_count"), u32v(count(&c["topk_group"]))),
        (k("rope.scaling.type"), Value::String("yarn".into())),
        (
            k("rope.scaling.factor"),
            Value::F32(num(&yarn["factor"]) as f32),
        ),
        (
            k("rope.scaling.original_context_length"),
            u32v(count(&yarn["original_max_position_embeddings"])),
        ),
        (
            k("rope.scaling.yarn_log_multiplier"),
            Value::F32((0.1 * num(&yarn["mscale_all_dim"])) as f32),
        ),
    ];
    if let Some(r) = q_rank {
        metadata.push((k("attention.q_lora_rank"), u32v(r)));
    }
    metadata
}

/// `metadata` with `over`'s keys replaced by `over`'s values.
pub fn override_metadata(metadata: &mut Vec<(String, Value)>, over: Vec<(String, Value)>) {
    metadata.retain(|(key, _)| !over.iter().any(|(k, _)| k == key));
    metadata.extend(over);
}

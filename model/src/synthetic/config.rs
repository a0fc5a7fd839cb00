//! The `config.json` of a synthetic model.
use super::{SyntheticFamily, SyntheticShape, WeightDType};

impl SyntheticShape {
    /// A Hugging Face `config.json` for this shape, with every field its family's reference (candle-transformers'
    /// config structs, which require some that HF makes optional) reads.
    pub fn config_json(&self, dtype: WeightDType) -> serde_json::Value {
        use SyntheticFamily as F;
        let mut c = serde_json::json!({
            "architectures": [match self.family {
                F::Llama => "LlamaForCausalLM",
                F::Mistral => "MistralForCausalLM",
                F::Mixtral => "MixtralForCausalLM",
                F::Qwen2 => "Qwen2ForCausalLM",
                F::Qwen3 => "Qwen3ForCausalLM",
                F::Qwen3Moe => "Qwen3MoeForCausalLM",
                F::Phi3 => "Phi3ForCausalLM",
                F::Gemma2 => "Gemma2ForCausalLM",
                F::Gemma3 => "Gemma3ForCausalLM",
                F::DeepseekV2 => "DeepseekV2ForCausalLM",
                F::DeepseekV3 => "DeepseekV3ForCausalLM",
                F::GptOss => "GptOssForCausalLM",
            }],
            "model_type": self.family.name(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_blocks,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim(),
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": if self.family.is_gemma() { "gelu_pytorch_tanh" } else { "silu" },
            "torch_dtype": match dtype {
                WeightDType::F32 => "float32",
                WeightDType::F16 => "float16",
                WeightDType::BF16 => "bfloat16",
            },
        });
        let window = self.sliding_window;
        let ex = self
            .expert_shape()
            .map_or((0, 0, 0, 0), |e| (e.count, e.per_token, e.size, e.shared));
        let extra = match self.family {
            F::Llama => serde_json::json!({}),
            F::Mistral | F::Phi3 => serde_json::json!({ "sliding_window": window }),
            F::Mixtral => serde_json::json!({ "sliding_window": window,
                "num_local_experts": ex.0, "num_experts_per_tok": ex.1, "use_flash_attn": false }),
            F::Qwen2 | F::Qwen3 => serde_json::json!({
                "sliding_window": window.unwrap_or(self.max_position),
                "use_sliding_window": window.is_some(), "max_window_layers": 1, "attention_bias": false }),
            F::Qwen3Moe => serde_json::json!({
                "sliding_window": window.unwrap_or(self.max_position),
                "use_sliding_window": window.is_some(), "max_window_layers": 1, "attention_bias": false,
                "num_experts": ex.0, "num_experts_per_tok": ex.1, "norm_topk_prob": true,
                "moe_intermediate_size": ex.2, "decoder_sparse_step": 1,
                "mlp_only_layers": [] }),
            F::DeepseekV2 | F::DeepseekV3 => {
                let (q_rank, kv_rank, nope, rope, value) = self.latent_dims();
                let v3 = self.family == F::DeepseekV3;
                serde_json::json!({
                    "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope,
                    "qk_rope_head_dim": rope, "v_head_dim": value, "attention_bias": false,
                    "num_key_value_heads": self.num_heads,
                    "n_routed_experts": ex.0, "num_experts_per_tok": ex.1, "moe_intermediate_size": ex.2,
                    "n_shared_experts": ex.3, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                    "topk_method": if v3 { "noaux_tc" } else { "greedy" },
                    "scoring_func": if v3 { "sigmoid" } else { "softmax" },
                    "n_group": if v3 { 4 } else { 1 }, "topk_group": if v3 { 2 } else { 1 },
                    "norm_topk_prob": v3, "routed_scaling_factor": if v3 { 2.5 } else { 1.5 },
                    "rope_scaling": { "type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": self.max_position / 4,
                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8 },
                })
            }
            // gpt-oss-20b's settings but the window (half the context, so that both kinds of layer differ on
            // long prompts), the clamp (low enough for random weights to reach) and YaRN's original context.
            F::GptOss => serde_json::json!({
                "attention_bias": true, "num_local_experts": ex.0, "num_experts_per_tok": ex.1,
                "sliding_window": window.unwrap_or(self.max_position / 2),
                "layer_types": (0..self.num_blocks)
                    .map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
                    .collect::<Vec<_>>(),
                "swiglu_limit": 7.0, "rope_theta": 150000.0,
                "rope_scaling": { "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": (self.max_position / 32).max(1) },
            }),
            F::Gemma2 | F::Gemma3 => serde_json::json!({
                "hidden_activation": "gelu_pytorch_tanh", "attention_bias": false,
                "query_pre_attn_scalar": self.head_dim(),
                "sliding_window": window.unwrap_or(self.max_position),
                "sliding_window_pattern": 3, "rope_local_base_freq": 1000.0,
                "final_logit_softcapping": if self.family == F::Gemma2 { Some(30.0) } else { None },
                "attn_logit_softcapping": if self.family == F::Gemma2 { Some(50.0) } else { None } }),
        };
        if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
            c.extend(extra.clone());
        }
        c
    }
}

//! Every tensor of a synthetic model as its Hugging Face checkpoint names it, with its shape and its values.
use super::values::Values;
use super::{ExpertShape, SyntheticFamily, SyntheticShape};

impl SyntheticShape {
    pub(super) fn tensor_kinds(&self) -> Vec<(String, Vec<usize>, Values)> {
        use SyntheticFamily as F;
        let (h, ff, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let (q, kv) = (self.num_heads * hd, self.num_kv_heads * hd);
        let norm = if self.family.is_gemma() {
            Values::NormMinusOne
        } else {
            Values::Norm
        };
        let w = |name: String, dims: Vec<usize>| (name, dims, Values::Weight);
        let mut t = vec![w(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
        )];
        for i in 0..self.num_blocks {
            let p = format!("model.layers.{i}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h], norm));
            if self.family.is_deepseek() {
                let (q_rank, kv_rank, nope, rope, value) = self.latent_dims();
                let (heads, a) = (self.num_heads, format!("{p}.self_attn"));
                let q_out = heads * (nope + rope);
                match q_rank {
                    Some(r) => t.extend([
                        w(format!("{a}.q_a_proj.weight"), vec![r, h]),
                        (format!("{a}.q_a_layernorm.weight"), vec![r], norm),
                        w(format!("{a}.q_b_proj.weight"), vec![q_out, r]),
                    ]),
                    None => t.push(w(format!("{a}.q_proj.weight"), vec![q_out, h])),
                }
                t.extend([
                    w(
                        format!("{a}.kv_a_proj_with_mqa.weight"),
                        vec![kv_rank + rope, h],
                    ),
                    (format!("{a}.kv_a_layernorm.weight"), vec![kv_rank], norm),
                    w(
                        format!("{a}.kv_b_proj.weight"),
                        vec![heads * (nope + value), kv_rank],
                    ),
                    w(format!("{a}.o_proj.weight"), vec![h, heads * value]),
                ]);
            } else if self.family == F::Phi3 {
                t.push(w(
                    format!("{p}.self_attn.qkv_proj.weight"),
                    vec![q + 2 * kv, h],
                ));
            } else {
                t.extend([
                    w(format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
                    w(format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                    w(format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                ]);
            }
            if matches!(self.family, F::Qwen2 | F::GptOss) {
                t.extend([
                    (
                        format!("{p}.self_attn.q_proj.bias"),
                        vec![q],
                        Values::Weight,
                    ),
                    (
                        format!("{p}.self_attn.k_proj.bias"),
                        vec![kv],
                        Values::Weight,
                    ),
                    (
                        format!("{p}.self_attn.v_proj.bias"),
                        vec![kv],
                        Values::Weight,
                    ),
                ]);
            }
            if matches!(self.family, F::Qwen3 | F::Qwen3Moe | F::Gemma3) {
                t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd], norm));
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd], norm));
            }
            if !self.family.is_deepseek() {
                t.push(w(format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            }
            if self.family == F::GptOss {
                t.extend([
                    w(format!("{p}.self_attn.o_proj.bias"), vec![h]),
                    (
                        format!("{p}.self_attn.sinks"),
                        vec![self.num_heads],
                        Values::Large,
                    ),
                ]);
            }
            t.push((
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                norm,
            ));
            if self.family.is_gemma() {
                t.push((
                    format!("{p}.pre_feedforward_layernorm.weight"),
                    vec![h],
                    norm,
                ));
                t.push((
                    format!("{p}.post_feedforward_layernorm.weight"),
                    vec![h],
                    norm,
                ));
            }
            // DeepSeek's first block keeps a dense MLP.
            let experts = self
                .expert_shape()
                .filter(|_| !(self.family.is_deepseek() && i == 0));
            match (self.family, experts) {
                // Stacked, input-major, gate and up interleaved; large biases so that the clamp bites.
                (
                    F::GptOss,
                    Some(ExpertShape {
                        count: n, size: ef, ..
                    }),
                ) => {
                    let m = format!("{p}.mlp");
                    t.extend([
                        w(format!("{m}.router.weight"), vec![n, h]),
                        w(format!("{m}.router.bias"), vec![n]),
                        w(format!("{m}.experts.gate_up_proj"), vec![n, h, 2 * ef]),
                        (
                            format!("{m}.experts.gate_up_proj_bias"),
                            vec![n, 2 * ef],
                            Values::Large,
                        ),
                        (
                            format!("{m}.experts.down_proj"),
                            vec![n, ef, h],
                            Values::Small,
                        ),
                        w(format!("{m}.experts.down_proj_bias"), vec![n, h]),
                    ]);
                }
                (F::Phi3, _) => t.extend([
                    w(format!("{p}.mlp.gate_up_proj.weight"), vec![2 * ff, h]),
                    w(format!("{p}.mlp.down_proj.weight"), vec![h, ff]),
                ]),
                (
                    _,
                    Some(ExpertShape {
                        count: n,
                        size: ef,
                        shared,
                        ..
                    }),
                ) => {
                    let (m, [gate, up, down]) = if self.family == F::Mixtral {
                        (format!("{p}.block_sparse_moe"), ["w1", "w3", "w2"])
                    } else {
                        (format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"])
                    };
                    t.push(w(format!("{m}.gate.weight"), vec![n, h]));
                    if self.family == F::DeepseekV3 {
                        t.push(w(format!("{m}.gate.e_score_correction_bias"), vec![n]));
                    }
                    for e in 0..n {
                        t.extend([
                            w(format!("{m}.experts.{e}.{gate}.weight"), vec![ef, h]),
                            w(format!("{m}.experts.{e}.{up}.weight"), vec![ef, h]),
                            w(format!("{m}.experts.{e}.{down}.weight"), vec![h, ef]),
                        ]);
                    }
                    if shared > 0 {
                        let sf = shared * ef;
                        t.extend([
                            w(format!("{m}.shared_experts.{gate}.weight"), vec![sf, h]),
                            w(format!("{m}.shared_experts.{up}.weight"), vec![sf, h]),
                            w(format!("{m}.shared_experts.{down}.weight"), vec![h, sf]),
                        ]);
                    }
                }
                _ => t.extend([
                    w(format!("{p}.mlp.gate_proj.weight"), vec![ff, h]),
                    w(format!("{p}.mlp.up_proj.weight"), vec![ff, h]),
                    w(format!("{p}.mlp.down_proj.weight"), vec![h, ff]),
                ]),
            }
        }
        t.push(("model.norm.weight".to_string(), vec![h], norm));
        if !self.tie_embeddings {
            t.push(w("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        t
    }
}

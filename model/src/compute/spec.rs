//! One description of a Llama-family model, read from a Hugging Face `config.json`, GGUF metadata or a llama2.c
//! header. Everything downstream (blocks, head, router) is built from this, never from format-specific fields.
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
}

impl ModelSpec {
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
        Ok(())
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of KV cache one token takes in one block at `dtype_size` bytes per element.
    pub fn kv_bytes_per_token_per_block(&self, dtype_size: usize) -> usize {
        2 * self.kv_dim() * dtype_size
    }

    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_config(name: &str, json: &str) -> Result<Self> {
        let c: HfConfig = serde_json::from_str(json)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        let arch = c
            .model_type
            .clone()
            .or_else(|| c.architectures.first().cloned())
            .unwrap_or_default();
        let known = matches!(
            arch.as_str(),
            "llama" | "mistral" | "LlamaForCausalLM" | "MistralForCausalLM"
        );
        if !known {
            return Err(ModelError::UnknownArchitecture(arch));
        }
        let num_heads = c.num_attention_heads;
        let head_dim = match c.head_dim {
            Some(d) => d,
            None if num_heads > 0 => c.hidden_size / num_heads,
            None => 0,
        };
        let rope_scaling = match c.rope_scaling {
            Some(s) if s.rope_type.as_deref().or(s.kind.as_deref()) == Some("llama3") => {
                Some(Llama3RopeScaling {
                    factor: s.factor.unwrap_or(1.0),
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position_embeddings: s
                        .original_max_position_embeddings
                        .unwrap_or(8192),
                })
            }
            Some(s) => match s.rope_type.as_deref().or(s.kind.as_deref()) {
                None | Some("default") => None,
                Some(other) => {
                    return Err(ModelError::Config(format!(
                        "rope_scaling type {other:?} is not supported (llama3 and default are)"
                    )))
                }
            },
            None => None,
        };
        let spec = Self {
            name: name.to_string(),
            architecture: "llama".into(),
            num_blocks: c.num_hidden_layers,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(num_heads),
            head_dim,
            vocab_size: c.vocab_size,
            rope_theta: c.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            rope_style: RopeStyle::Half,
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6),
            max_position: c.max_position_embeddings.unwrap_or(4096),
            tie_embeddings: c.tie_word_embeddings.unwrap_or(false),
            bos_token_id: c.bos_token_id,
            eos_token_ids: match c.eos_token_id {
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
                None => vec![],
            },
        };
        spec.validate()?;
        Ok(spec)
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
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[cfg(test)]
mod tests {
    use super::*;

    const STORIES: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":512,
        "hidden_size":64,"intermediate_size":172,"num_hidden_layers":5,"num_attention_heads":8,
        "num_key_value_heads":4,"max_position_embeddings":512,"rms_norm_eps":1e-05,"rope_theta":10000.0,
        "tie_word_embeddings":true,"bos_token_id":1,"eos_token_id":2,"rope_scaling":null}"#;

    #[test]
    fn parses_hf_config() {
        let s = ModelSpec::from_hf_config("stories", STORIES).unwrap();
        assert_eq!(
            (
                s.num_blocks,
                s.hidden_size,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim
            ),
            (5, 64, 8, 4, 8)
        );
        assert!(s.tie_embeddings);
        assert_eq!(s.eos_token_ids, vec![2]);
        assert_eq!(s.rope_style, RopeStyle::Half);
    }

    #[test]
    fn llama3_rope_scaling() {
        let json = STORIES.replace(
            r#""rope_scaling":null"#,
            r#""rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
               "original_max_position_embeddings":8192,"rope_type":"llama3"},"eos_token_id":[2,3]"#,
        );
        let json = json.replace(r#""eos_token_id":2,"#, "");
        let s = ModelSpec::from_hf_config("l3", &json).unwrap();
        assert_eq!(s.rope_scaling.unwrap().factor, 8.0);
        assert_eq!(s.eos_token_ids, vec![2, 3]);
    }

    #[test]
    fn unknown_architecture_is_an_error() {
        let json = STORIES.replace("\"llama\"", "\"gpt_neox\"");
        assert!(matches!(
            ModelSpec::from_hf_config("x", &json),
            Err(ModelError::UnknownArchitecture(a)) if a == "gpt_neox"
        ));
    }

    #[test]
    fn inconsistent_heads_are_an_error() {
        let json = STORIES.replace("\"num_key_value_heads\":4", "\"num_key_value_heads\":3");
        assert!(matches!(
            ModelSpec::from_hf_config("x", &json),
            Err(ModelError::Config(_))
        ));
    }
}

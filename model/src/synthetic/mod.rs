//! Random-weight models of every supported family, written as Hugging Face directories (`config.json` +
//! `model.safetensors`), and Llama-architecture ones at real scale as quantized GGUF files ([`write_gguf`]).
//!
//! Benchmarks need shapes no model on disk has (a 1B model on a machine with only a 135M one), and tests need
//! models they can build in milliseconds. Weights are uniform on a grid of `k / 4096` for `k` in `-127..=127`
//! (std ~0.018, close to the usual 0.02 init), so every value is exact in f32, f16 and bf16: the same seed gives
//! the same model in any dtype, and activations stay finite through many blocks. Norm weights are `1 + k / 128`
//! for `k` in `-32..=32` (Gemma's, stored as `w - 1`, are `k / 128`), also exact in every dtype, so a norm that is
//! applied wrongly changes the outputs.
//!
//! The file is streamed tensor by tensor through a byte lookup table, so a 1B model is written in seconds and never
//! held in memory. Only `std` and `serde_json` are used here (the GGUF writer also reads its tokenizer with candle).
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

mod config;
mod gguf;
mod gguf_deepseek;
mod gguf_gpt_oss;
mod gguf_header;
mod mxfp4_checkpoint;
mod shapes;
mod tensors;
mod values;

pub use gguf::{write_gguf, GgufFormat, GgufTokenizer, WrittenGguf};
pub use gguf_deepseek::{deepseek2_metadata, override_metadata};
pub use gguf_gpt_oss::gpt_oss_gguf_from_hf;
pub use mxfp4_checkpoint::gpt_oss_mxfp4_checkpoint;
pub use shapes::{MINI, SHAPES};

#[cfg(test)]
use values::{encode, f16_bits};
use values::{fnv1a, large_value, norm_value, small_value, SplitMix64, ValueTable, Values};

/// The dtype weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDType {
    F32,
    F16,
    BF16,
}

impl WeightDType {
    /// Parses `f32`, `f16` or `bf16` (as `--dtype` takes them).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(Self::F32),
            "f16" | "float16" | "half" => Some(Self::F16),
            "bf16" | "bfloat16" => Some(Self::BF16),
            _ => None,
        }
    }

    pub fn size_in_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    /// The dtype's name in a safetensors header.
    fn safetensors_name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
        }
    }

    /// Lower-case name, as in directory names and `--dtype`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
        }
    }
}

/// A supported family, as a synthetic model of it is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntheticFamily {
    Llama,
    Mistral,
    /// Mistral with [`MIXTRAL_EXPERTS`] experts, two per token.
    Mixtral,
    Qwen2,
    Qwen3,
    /// Qwen3 with a mixture of experts (by default [`QWEN3_MOE_EXPERTS`] of half the dense width, two per
    /// token), weights renormalised.
    Qwen3Moe,
    Phi3,
    Gemma2,
    Gemma3,
    /// Latent attention (low-rank queries), YaRN, softmax routing to [`DEEPSEEK_EXPERTS`] experts with a shared one
    /// and a dense first block.
    DeepseekV2,
    /// DeepSeek-V2 with one query projection and V3's routing: sigmoid scores, a choice bias, the best two of four
    /// groups.
    DeepseekV3,
    /// Attention sinks, every other layer windowed, biases on attention and on [`GPT_OSS_EXPERTS`] experts of the
    /// dense width (two per token), clamped SwiGLU, YaRN.
    GptOss,
}

/// Experts per block of a synthetic Mixtral, unless its shape says otherwise.
pub const MIXTRAL_EXPERTS: usize = 4;
/// Experts per block of a synthetic Qwen3-MoE, unless its shape says otherwise.
pub const QWEN3_MOE_EXPERTS: usize = 8;
/// Routed experts per block of a synthetic DeepSeek, unless its shape says otherwise.
pub const DEEPSEEK_EXPERTS: usize = 8;
/// Experts per block of a synthetic gpt-oss, unless its shape says otherwise.
pub const GPT_OSS_EXPERTS: usize = 8;

/// The experts of a mixture: `count` per block, `per_token` chosen for each token, each `size` wide, and `shared`
/// more of that width that every token goes through (DeepSeek's, written as one MLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShape {
    pub count: usize,
    pub per_token: usize,
    pub size: usize,
    pub shared: usize,
}

/// DeepSeek's latent attention widths where not derived from the head size (see [`SyntheticShape::latent_dims`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentShape {
    pub q_rank: Option<usize>,
    pub kv_rank: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub value_dim: usize,
}

impl SyntheticFamily {
    pub const ALL: [Self; 12] = [
        Self::Llama,
        Self::Mistral,
        Self::Mixtral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Qwen3Moe,
        Self::Phi3,
        Self::Gemma2,
        Self::Gemma3,
        Self::DeepseekV2,
        Self::DeepseekV3,
        Self::GptOss,
    ];

    /// The HF `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Mixtral => "mixtral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Phi3 => "phi3",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
            Self::DeepseekV2 => "deepseek_v2",
            Self::DeepseekV3 => "deepseek_v3",
            Self::GptOss => "gpt_oss",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s || (s == "gemma3" && *f == Self::Gemma3))
    }

    fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    fn is_deepseek(self) -> bool {
        matches!(self, Self::DeepseekV2 | Self::DeepseekV3)
    }
}

/// The shape of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticShape {
    pub name: &'static str,
    pub hidden_size: usize,
    pub num_blocks: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub tie_embeddings: bool,
    pub max_position: usize,
    pub family: SyntheticFamily,
    /// Window of the family's windowed layers (all for Mistral/Mixtral/Phi-3, every other for Gemma 2, five in six
    /// for Gemma 3, from layer 1 for Qwen); `None`: no layer is windowed (Gemma's then get `max_position`).
    pub sliding_window: Option<usize>,
    /// Width of an attention head where it is not `hidden_size / num_heads` (Qwen3-MoE's 128 over 2048).
    pub head_size: Option<usize>,
    /// DeepSeek's latent attention widths, where not derived from the head size.
    pub latent: Option<LatentShape>,
    /// The experts of a Mixtral or Qwen3-MoE where not its family's default (see [`SyntheticShape::expert_shape`]).
    pub experts: Option<ExpertShape>,
}

impl SyntheticShape {
    /// The shape called `name` in [`SHAPES`].
    pub fn named(name: &str) -> Option<Self> {
        SHAPES
            .iter()
            .find(|s| s.name.eq_ignore_ascii_case(name.trim()))
            .copied()
    }

    pub fn head_dim(&self) -> usize {
        self.head_size.unwrap_or(self.hidden_size / self.num_heads)
    }

    /// The experts of this shape's mixture: those it names, else its family's default (Mixtral's as wide as the
    /// dense width, Qwen3-MoE's half as wide, so that the two cannot be confused); `None` for a dense family.
    pub fn expert_shape(&self) -> Option<ExpertShape> {
        let default = match self.family {
            SyntheticFamily::Mixtral => ExpertShape {
                count: MIXTRAL_EXPERTS,
                per_token: 2,
                size: self.intermediate_size,
                shared: 0,
            },
            SyntheticFamily::Qwen3Moe => ExpertShape {
                count: QWEN3_MOE_EXPERTS,
                per_token: 2,
                size: self.intermediate_size / 2,
                shared: 0,
            },
            SyntheticFamily::DeepseekV2 | SyntheticFamily::DeepseekV3 => ExpertShape {
                count: DEEPSEEK_EXPERTS,
                per_token: 2,
                size: self.intermediate_size / 2,
                shared: 1,
            },
            SyntheticFamily::GptOss => ExpertShape {
                count: GPT_OSS_EXPERTS,
                per_token: 2,
                size: self.intermediate_size,
                shared: 0,
            },
            _ => return None,
        };
        Some(self.experts.unwrap_or(default))
    }

    /// DeepSeek's latent attention at this shape: `(q_rank, kv_rank, nope_dim, rope_dim, value_dim)`, the shape's
    /// own or derived from the head size, a value narrower than the key so that the two cannot be confused and
    /// low-rank queries for V2 only.
    pub fn latent_dims(&self) -> (Option<usize>, usize, usize, usize, usize) {
        if let Some(l) = self.latent {
            return (l.q_rank, l.kv_rank, l.nope_dim, l.rope_dim, l.value_dim);
        }
        let hd = self.head_dim();
        let q_rank = (self.family == SyntheticFamily::DeepseekV2).then_some(self.hidden_size / 2);
        (q_rank, self.hidden_size / 2, hd, hd / 2, 3 * hd / 4)
    }

    /// This shape as a model of `family` (same widths; Gemma always ties its LM head, Mistral-style models never
    /// do in candle's reference).
    pub fn with_family(mut self, family: SyntheticFamily) -> Self {
        self.family = family;
        match family {
            SyntheticFamily::Gemma2 | SyntheticFamily::Gemma3 => self.tie_embeddings = true,
            SyntheticFamily::Mistral
            | SyntheticFamily::Mixtral
            | SyntheticFamily::Phi3
            | SyntheticFamily::DeepseekV2
            | SyntheticFamily::DeepseekV3
            | SyntheticFamily::GptOss => self.tie_embeddings = false,
            _ => {}
        }
        self
    }

    /// Every tensor of the model, in file order, with its shape and what kind of values it holds.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.tensor_kinds()
            .into_iter()
            .map(|(name, dims, _)| (name, dims))
            .collect()
    }

    /// Number of weights.
    pub fn parameters(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }
}

/// What [`write_model`] did.
#[derive(Debug, Clone)]
pub struct Written {
    pub dir: PathBuf,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
    /// False when an identical model (same shape, dtype and seed) was already there and was kept.
    pub written: bool,
}

/// The marker recording what a directory holds, so a kept `--synthetic-dir` is not rewritten.
const MARKER: &str = "petal_synthetic.json";

/// Writes a random-weight model of `shape` in `dtype` into `dir` (created if needed). If `dir` already holds the
/// same shape, dtype and seed, it is kept as is.
pub fn write_model(
    dir: &Path,
    shape: &SyntheticShape,
    dtype: WeightDType,
    seed: u64,
) -> io::Result<Written> {
    std::fs::create_dir_all(dir)?;
    let marker = serde_json::json!({ "shape": shape.name, "dtype": dtype.name(), "seed": seed,
        "config": shape.config_json(dtype) });
    let weights = dir.join("model.safetensors");
    if is_current(&dir.join(MARKER), &marker, &weights) {
        let bytes = std::fs::metadata(&weights)?.len();
        return Ok(Written {
            dir: dir.to_path_buf(),
            bytes,
            written: false,
        });
    }
    // The marker goes last: a write cut short leaves no marker and is redone next time.
    let _ = std::fs::remove_file(dir.join(MARKER));
    let config =
        serde_json::to_string_pretty(&shape.config_json(dtype)).map_err(io::Error::other)?;
    std::fs::write(dir.join("config.json"), config)?;
    let bytes = write_safetensors(&weights, shape, dtype, seed)?;
    std::fs::write(dir.join(MARKER), marker.to_string())?;
    Ok(Written {
        dir: dir.to_path_buf(),
        bytes,
        written: true,
    })
}

/// Whether the marker at `marker_path` says `marker` and the file it vouches for, `weights`, is there.
pub(super) fn is_current(marker_path: &Path, marker: &serde_json::Value, weights: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(marker_path) else {
        return false;
    };
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .as_ref()
        == Some(marker)
        && weights.exists()
}

/// Streams the safetensors file: header, then each tensor's bytes drawn from a seeded generator.
fn write_safetensors(
    path: &Path,
    shape: &SyntheticShape,
    dtype: WeightDType,
    seed: u64,
) -> io::Result<u64> {
    let kinds = shape.tensor_kinds();
    let tensors = shape.tensors();
    let header = safetensors_header(&tensors, dtype)?;
    let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(&header)?;
    let weights = ValueTable::new(dtype, |k| k as f32 / 4096.0);
    let norms = ValueTable::new(dtype, norm_value);
    let norms_minus_one = ValueTable::new(dtype, |k| (k / 4) as f32 / 128.0);
    let large = ValueTable::new(dtype, large_value);
    let small = ValueTable::new(dtype, small_value);
    for (name, dims, values) in &kinds {
        let count: usize = dims.iter().product();
        let table = match values {
            Values::Weight => &weights,
            Values::Norm => &norms,
            Values::NormMinusOne => &norms_minus_one,
            Values::Large => &large,
            Values::Small => &small,
        };
        let mut rng = SplitMix64::new(seed ^ fnv1a(name.as_bytes()));
        table.write_random(&mut out, count, &mut rng)?;
    }
    out.flush()?;
    Ok(8 + header.len() as u64
        + tensors
            .iter()
            .map(|(_, d)| (d.iter().product::<usize>() * dtype.size_in_bytes()) as u64)
            .sum::<u64>())
}

/// The JSON header (offsets in file order), padded with spaces to a multiple of 8 bytes as the format allows.
fn safetensors_header(tensors: &[(String, Vec<usize>)], dtype: WeightDType) -> io::Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert(
        "__metadata__".into(),
        serde_json::json!({ "format": "pt", "petal": "synthetic" }),
    );
    let mut offset = 0usize;
    for (name, dims) in tensors {
        let len = dims.iter().product::<usize>() * dtype.size_in_bytes();
        map.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype.safetensors_name(), "shape": dims,
                "data_offsets": [offset, offset + len] }),
        );
        offset += len;
    }
    let mut header =
        serde_json::to_vec(&serde_json::Value::Object(map)).map_err(io::Error::other)?;
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_exact_in_every_dtype() {
        for k in [-127i32, -1, 1, 37, 127] {
            let v = k as f32 / 4096.0;
            let f16 = f16_bits(v);
            // Decode f16 by hand: normal numbers only.
            let exp = i32::from((f16 >> 10) & 0x1f) - 15;
            let mant = 1.0 + f32::from(f16 & 0x3ff) / 1024.0;
            let back = if f16 & 0x8000 != 0 { -1.0 } else { 1.0 } * mant * 2f32.powi(exp);
            assert_eq!(back, v);
            let bf16 = u16::from_le_bytes([
                encode(v, WeightDType::BF16)[0],
                encode(v, WeightDType::BF16)[1],
            ]);
            assert_eq!(f32::from_bits(u32::from(bf16) << 16), v);
        }
    }

    #[test]
    fn writes_a_well_formed_file_once() {
        let dir = std::env::temp_dir().join(format!("petal-synthetic-test-{}", std::process::id()));
        let shape = SyntheticShape::named("tiny").unwrap();
        let w = write_model(&dir, &shape, WeightDType::BF16, 7).unwrap();
        assert!(w.written);
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        assert_eq!(bytes.len() as u64, w.bytes);
        assert_eq!(
            w.bytes,
            8 + header_len(&bytes) as u64 + shape.parameters() * 2
        );
        let header: serde_json::Value =
            serde_json::from_slice(&bytes[8..8 + header_len(&bytes)]).unwrap();
        assert_eq!(
            header["model.layers.3.mlp.down_proj.weight"]["shape"],
            serde_json::json!([256, 704])
        );
        assert!(header.get("lm_head.weight").is_none());
        assert!(
            !write_model(&dir, &shape, WeightDType::BF16, 7)
                .unwrap()
                .written
        );
        assert!(
            write_model(&dir, &shape, WeightDType::F32, 7)
                .unwrap()
                .written
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn header_len(bytes: &[u8]) -> usize {
        u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
    }
}

//! Random-weight Llama- and Qwen3-MoE-architecture models written as GGUF files in the quantizations users
//! download (Q4_0, Q8_0, Q4_K_M, Q5_K_M, MXFP4_MOE), at real scale: an 8B-, 70B- or 30B-A3B-shaped file takes the bytes of
//! the real one. Experts are stacked in one 3-D tensor per matrix, as llama.cpp's converter writes them.
//!
//! Quantized blocks are random bytes in each format's block layout with the scales set so that every weight has a
//! standard deviation near 0.02 (the usual init), which keeps activations finite through 80 blocks. The
//! tokenizer's metadata (and so the vocabulary, which sets the embedding's rows) is copied from a GGUF the caller
//! names, so the file runs with text in Petal and in llama.cpp alike. Written streaming, tensor by tensor, at the
//! speed of the disk; a file already written with the same shape, format, tokenizer and seed is kept.
use super::gguf_deepseek::{deepseek2_metadata, override_metadata};
use super::gguf_gpt_oss::{gpt_oss_block, gpt_oss_metadata};
use super::gguf_header::{write_header, TensorType};
use super::values::{fnv1a, large_value, norm_value, small_value, SplitMix64, ValueTable, Values};
use super::{is_current, SyntheticFamily, SyntheticShape, WeightDType};
use crate::compute::linear::mxfp4;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::GgmlDType;
use std::fs::File;
use std::io::{self, BufWriter, Seek, Write};
use std::path::{Path, PathBuf};

/// A llama.cpp file type (`llama-quantize`'s names), as its tensors are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufFormat {
    Q4_0,
    Q8_0,
    /// Q4_K, with Q6_K for the LM head and for `attn_v` and `ffn_down` in the blocks llama.cpp gives more bits.
    Q4KM,
    /// Q5_K, with Q6_K where Q4_K_M has it.
    Q5KM,
    /// Every matrix in f32: no quantization between two engines that are compared.
    F32,
    /// llama-quantize's MXFP4_MOE (gpt-oss's files): stacked experts in MXFP4, every other matrix in Q8_0.
    Mxfp4Moe,
}

impl GgufFormat {
    pub const ALL: [Self; 6] = [
        Self::Q4_0,
        Self::Q8_0,
        Self::Q4KM,
        Self::Q5KM,
        Self::F32,
        Self::Mxfp4Moe,
    ];

    /// Parses `q4_0`, `q8_0`, `q4_k_m`, `q5_k_m`, `f32` or `mxfp4_moe` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim().to_ascii_lowercase();
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "q4_0",
            Self::Q8_0 => "q8_0",
            Self::Q4KM => "q4_k_m",
            Self::Q5KM => "q5_k_m",
            Self::F32 => "f32",
            Self::Mxfp4Moe => "mxfp4_moe",
        }
    }

    /// `general.file_type`: llama.cpp's `LLAMA_FTYPE_MOSTLY_*`.
    fn file_type(self) -> u32 {
        match self {
            Self::Q4_0 => 2,
            Self::Q8_0 => 7,
            Self::Q4KM => 15,
            Self::Q5KM => 17,
            Self::F32 => 0,
            Self::Mxfp4Moe => 38,
        }
    }

    fn base(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q8_0 | Self::Mxfp4Moe => GgmlDType::Q8_0,
            Self::Q4KM => GgmlDType::Q4K,
            Self::Q5KM => GgmlDType::Q5K,
            Self::F32 => GgmlDType::F32,
        }
    }

    /// The type llama-quantize gives the matrix `role` of block `block` of `blocks` (`None`: the LM head).
    fn matrix_type(self, role: Role, block: Option<(usize, usize)>) -> GgmlDType {
        let k_quant = matches!(self, Self::Q4KM | Self::Q5KM);
        match (role, block) {
            (Role::Output, _) if matches!(self, Self::Q8_0 | Self::F32 | Self::Mxfp4Moe) => {
                self.base()
            }
            (Role::Output, _) => GgmlDType::Q6K,
            (Role::MoreBits, Some((i, n))) if k_quant && use_more_bits(i, n) => GgmlDType::Q6K,
            _ => self.base(),
        }
    }

    /// `t` (one expert's matrix, typed by [`Self::matrix_type`]) as the stack of `experts` of them: in MXFP4 for
    /// [`Self::Mxfp4Moe`] where its rows split into MXFP4 blocks.
    pub(super) fn stacked(self, t: GgufTensor, experts: usize) -> GgufTensor {
        let mxfp4 = self == Self::Mxfp4Moe && t.dims[0].is_multiple_of(mxfp4::QK_MXFP4);
        GgufTensor {
            dims: vec![t.dims[0], t.dims[1], experts],
            dtype: if mxfp4 { TensorType::Mxfp4 } else { t.dtype },
            ..t
        }
    }
}

/// What a matrix is, as far as the choice of its type goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// `output.weight`.
    Output,
    /// `attn_v` and `ffn_down`, which the `_M` mixes quantize finer in some blocks.
    MoreBits,
    Plain,
}

/// llama.cpp's rule for the blocks whose `attn_v` and `ffn_down` get Q6_K in a `_M` mix: the first and last
/// eighth, and every third one between.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The tokenizer a synthetic GGUF carries: the `tokenizer.*` metadata of another GGUF.
pub struct GgufTokenizer {
    metadata: Vec<(String, Value)>,
    vocab_size: usize,
    source: PathBuf,
}

impl GgufTokenizer {
    /// Reads the tokenizer of the GGUF at `path` (SmolLM2's, say): every `tokenizer.*` key.
    pub fn from_gguf(path: &Path) -> io::Result<Self> {
        let mut file = File::open(path)?;
        let content = gguf_file::Content::read(&mut file).map_err(io::Error::other)?;
        let mut metadata: Vec<(String, Value)> = content
            .metadata
            .into_iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .collect();
        metadata.sort_by(|a, b| a.0.cmp(&b.0));
        let vocab_size = metadata
            .iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
            .and_then(|(_, v)| v.to_vec().ok().map(|t| t.len()))
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: no tokenizer.ggml.tokens", path.display()),
                )
            })?;
        Ok(Self {
            metadata,
            vocab_size,
            source: path.to_path_buf(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

/// A GGUF file [`write_gguf`] wrote or found already written.
#[derive(Debug, Clone)]
pub struct WrittenGguf {
    pub path: PathBuf,
    pub bytes: u64,
    /// False when an identical file was already there.
    pub written: bool,
}

/// Writes `shape` (a Llama-family shape; its vocabulary is the tokenizer's) as a GGUF of `format` at `path`. An
/// existing file written with the same shape, format, tokenizer and seed is kept.
pub fn write_gguf(
    path: &Path,
    shape: &SyntheticShape,
    format: GgufFormat,
    tokenizer: &GgufTokenizer,
    seed: u64,
) -> io::Result<WrittenGguf> {
    let supported = matches!(
        shape.family,
        SyntheticFamily::Llama
            | SyntheticFamily::Qwen3Moe
            | SyntheticFamily::DeepseekV2
            | SyntheticFamily::DeepseekV3
            | SyntheticFamily::GptOss
    );
    if !supported {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "synthetic GGUF files are Llama, Qwen3-MoE, DeepSeek or gpt-oss; {} is not",
                shape.family.name()
            ),
        ));
    }
    let shape = SyntheticShape {
        vocab_size: tokenizer.vocab_size,
        ..*shape
    };
    let tensors = gguf_tensors(&shape, format);
    for t in &tensors {
        if t.dims[0] % t.dtype.block_size() != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: rows of {} do not split into {:?} blocks of {}",
                    t.name,
                    t.dims[0],
                    t.dtype,
                    t.dtype.block_size()
                ),
            ));
        }
    }
    let marker_path = path.with_extension("gguf.json");
    let marker = serde_json::json!({
        "shape": shape.name, "format": format.name(), "seed": seed,
        "tokenizer": tokenizer.source.display().to_string(), "vocab": shape.vocab_size,
        "hidden": shape.hidden_size, "blocks": shape.num_blocks, "ffn": shape.intermediate_size,
        "heads": shape.num_heads, "kv_heads": shape.num_kv_heads, "family": shape.family.name(),
        "head_dim": shape.head_dim(),
        "experts": shape.expert_shape().map(|e| [e.count, e.per_token, e.size, e.shared]),
        "latent": format!("{:?}", shape.latent_dims()),
    });
    if is_current(&marker_path, &marker, path) {
        return Ok(WrittenGguf {
            path: path.to_path_buf(),
            bytes: std::fs::metadata(path)?.len(),
            written: false,
        });
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(&marker_path);
    // Written aside and renamed: a run cut short never leaves a file that looks whole.
    let partial = path.with_extension("gguf.partial");
    let bytes = {
        let mut out = BufWriter::with_capacity(1 << 22, File::create(&partial)?);
        let metadata = gguf_metadata(&shape, format, Some(tokenizer));
        write_header(&mut out, &metadata, &tensors)?;
        for t in &tensors {
            let mut rng = SplitMix64::new(seed ^ fnv1a(t.name.as_bytes()));
            write_tensor(&mut out, t, &mut rng)?;
            pad(&mut out)?;
        }
        out.flush()?;
        out.stream_position()?
    };
    std::fs::rename(&partial, path)?;
    std::fs::write(&marker_path, marker.to_string())?;
    Ok(WrittenGguf {
        path: path.to_path_buf(),
        bytes,
        written: true,
    })
}

/// One tensor of the file: GGUF's dimensions (the row length first).
pub(super) struct GgufTensor {
    pub name: String,
    pub dims: Vec<usize>,
    pub dtype: TensorType,
    /// What an f32 tensor holds (a quantized one holds random blocks of weights).
    pub values: Values,
}

impl GgufTensor {
    pub(super) fn bytes(&self) -> usize {
        let elems: usize = self.dims.iter().product();
        elems / self.dtype.block_size() * self.dtype.type_size()
    }
}

/// Every tensor in file order: the embedding, each block's in llama.cpp's order, the final norm and the head.
fn gguf_tensors(shape: &SyntheticShape, format: GgufFormat) -> Vec<GgufTensor> {
    let (h, ff, hd) = (shape.hidden_size, shape.intermediate_size, shape.head_dim());
    let (q, kv) = (shape.num_heads * hd, shape.num_kv_heads * hd);
    let n = shape.num_blocks;
    let deepseek = matches!(
        shape.family,
        SyntheticFamily::DeepseekV2 | SyntheticFamily::DeepseekV3
    );
    // As llama-quantize: a row that the format's blocks do not split falls back to Q8_0, else f32.
    let fits = |dtype: GgmlDType, cols: usize| match dtype {
        d if cols.is_multiple_of(d.block_size()) => d,
        _ if cols.is_multiple_of(GgmlDType::Q8_0.block_size()) => GgmlDType::Q8_0,
        _ => GgmlDType::F32,
    };
    let matrix =
        |name: String, rows: usize, cols: usize, role: Role, block: Option<usize>| GgufTensor {
            name,
            dims: vec![cols, rows],
            dtype: TensorType::Ggml(fits(format.matrix_type(role, block.map(|i| (i, n))), cols)),
            values: Values::Weight,
        };
    let norm = |name: String, len: usize| GgufTensor {
        name,
        dims: vec![len],
        dtype: TensorType::F32,
        values: Values::Norm,
    };
    let mut t = vec![matrix(
        "token_embd.weight".into(),
        shape.vocab_size,
        h,
        Role::Plain,
        None,
    )];
    for i in 0..n {
        let p = format!("blk.{i}");
        let b = Some(i);
        if shape.family == SyntheticFamily::GptOss {
            t.extend(gpt_oss_block(
                shape,
                format,
                &p,
                &|name, rows, cols, more_bits| {
                    let role = if more_bits {
                        Role::MoreBits
                    } else {
                        Role::Plain
                    };
                    matrix(name, rows, cols, role, b)
                },
            ));
            continue;
        }
        if deepseek {
            // llama.cpp's MLA layout: the latent's expansion split per head, the key's transposed.
            let (q_rank, kv_rank, nope, rope, value) = shape.latent_dims();
            let heads = shape.num_heads;
            let q_out = heads * (nope + rope);
            t.push(norm(format!("{p}.attn_norm.weight"), h));
            match q_rank {
                Some(r) => t.extend([
                    matrix(format!("{p}.attn_q_a.weight"), r, h, Role::Plain, b),
                    norm(format!("{p}.attn_q_a_norm.weight"), r),
                    matrix(format!("{p}.attn_q_b.weight"), q_out, r, Role::Plain, b),
                ]),
                None => t.push(matrix(
                    format!("{p}.attn_q.weight"),
                    q_out,
                    h,
                    Role::Plain,
                    b,
                )),
            }
            let per_head = |name: &str, rows: usize, cols: usize| GgufTensor {
                dims: vec![cols, rows, heads],
                ..matrix(format!("{p}.{name}"), rows, cols, Role::Plain, b)
            };
            t.extend([
                matrix(
                    format!("{p}.attn_kv_a_mqa.weight"),
                    kv_rank + rope,
                    h,
                    Role::Plain,
                    b,
                ),
                norm(format!("{p}.attn_kv_a_norm.weight"), kv_rank),
                per_head("attn_k_b.weight", kv_rank, nope),
                per_head("attn_v_b.weight", value, kv_rank),
                matrix(
                    format!("{p}.attn_output.weight"),
                    h,
                    heads * value,
                    Role::Plain,
                    b,
                ),
            ]);
        } else {
            t.extend([
                norm(format!("{p}.attn_norm.weight"), h),
                matrix(format!("{p}.attn_q.weight"), q, h, Role::Plain, b),
                matrix(format!("{p}.attn_k.weight"), kv, h, Role::Plain, b),
                matrix(format!("{p}.attn_v.weight"), kv, h, Role::MoreBits, b),
                matrix(format!("{p}.attn_output.weight"), h, q, Role::Plain, b),
            ]);
        }
        if shape.family == SyntheticFamily::Qwen3Moe {
            t.extend([
                norm(format!("{p}.attn_q_norm.weight"), hd),
                norm(format!("{p}.attn_k_norm.weight"), hd),
            ]);
        }
        t.push(norm(format!("{p}.ffn_norm.weight"), h));
        // DeepSeek's first block keeps a dense MLP.
        match shape.expert_shape().filter(|_| !(deepseek && i == 0)) {
            Some(e) => {
                // llama.cpp keeps the router in f32 and gives ffn_down_exps the bits ffn_down gets.
                let stacked = |name: &str, rows: usize, cols: usize, role: Role| {
                    format.stacked(matrix(format!("{p}.{name}"), rows, cols, role, b), e.count)
                };
                t.extend([
                    GgufTensor {
                        name: format!("{p}.ffn_gate_inp.weight"),
                        dims: vec![h, e.count],
                        dtype: TensorType::F32,
                        values: Values::Weight,
                    },
                    stacked("ffn_gate_exps.weight", e.size, h, Role::Plain),
                    stacked("ffn_up_exps.weight", e.size, h, Role::Plain),
                    stacked("ffn_down_exps.weight", h, e.size, Role::MoreBits),
                ]);
                if shape.family == SyntheticFamily::DeepseekV3 {
                    t.push(GgufTensor {
                        name: format!("{p}.exp_probs_b.bias"),
                        dims: vec![e.count],
                        dtype: TensorType::F32,
                        values: Values::Weight,
                    });
                }
                if e.shared > 0 {
                    let sf = e.shared * e.size;
                    t.extend([
                        matrix(format!("{p}.ffn_gate_shexp.weight"), sf, h, Role::Plain, b),
                        matrix(format!("{p}.ffn_up_shexp.weight"), sf, h, Role::Plain, b),
                        matrix(
                            format!("{p}.ffn_down_shexp.weight"),
                            h,
                            sf,
                            Role::MoreBits,
                            b,
                        ),
                    ]);
                }
            }
            None => t.extend([
                matrix(format!("{p}.ffn_gate.weight"), ff, h, Role::Plain, b),
                matrix(format!("{p}.ffn_up.weight"), ff, h, Role::Plain, b),
                matrix(format!("{p}.ffn_down.weight"), h, ff, Role::MoreBits, b),
            ]),
        }
    }
    t.push(norm("output_norm.weight".into(), h));
    if !shape.tie_embeddings {
        t.push(matrix(
            "output.weight".into(),
            shape.vocab_size,
            h,
            Role::Output,
            None,
        ));
    }
    t
}

pub(super) const ALIGNMENT: u64 = 32;

pub(super) fn pad<W: Write + Seek>(out: &mut W) -> io::Result<()> {
    let pos = out.stream_position()?;
    let padding = (ALIGNMENT - pos % ALIGNMENT) % ALIGNMENT;
    out.write_all(&[0u8; ALIGNMENT as usize][..padding as usize])
}

/// The file's metadata: the architecture's keys for `shape` (as llama.cpp's converter writes them), then the
/// tokenizer's.
pub(super) fn gguf_metadata(
    shape: &SyntheticShape,
    format: GgufFormat,
    tokenizer: Option<&GgufTokenizer>,
) -> Vec<(String, Value)> {
    let u32v = |v: usize| Value::U32(v as u32);
    let arch = match shape.family {
        SyntheticFamily::Qwen3Moe => "qwen3moe",
        SyntheticFamily::DeepseekV2 | SyntheticFamily::DeepseekV3 => "deepseek2",
        SyntheticFamily::GptOss => "gpt-oss",
        _ => "llama",
    };
    let k = |key: &str| format!("{arch}.{key}");
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(format!("petal-synthetic-{}", shape.name)),
        ),
        ("general.file_type".into(), Value::U32(format.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (k("context_length"), u32v(shape.max_position)),
        (k("embedding_length"), u32v(shape.hidden_size)),
        (k("block_count"), u32v(shape.num_blocks)),
        (k("feed_forward_length"), u32v(shape.intermediate_size)),
        (k("rope.dimension_count"), u32v(shape.head_dim())),
        (k("attention.head_count"), u32v(shape.num_heads)),
        (k("attention.head_count_kv"), u32v(shape.num_kv_heads)),
        (k("attention.key_length"), u32v(shape.head_dim())),
        (k("attention.value_length"), u32v(shape.head_dim())),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("rope.freq_base"), Value::F32(500_000.0)),
        (k("vocab_size"), u32v(shape.vocab_size)),
    ];
    if let Some(e) = shape.expert_shape() {
        metadata.extend([
            (k("expert_count"), u32v(e.count)),
            (k("expert_used_count"), u32v(e.per_token)),
            (k("expert_feed_forward_length"), u32v(e.size)),
        ]);
    }
    if arch == "deepseek2" {
        override_metadata(&mut metadata, deepseek2_metadata(shape));
    }
    if arch == "gpt-oss" {
        override_metadata(&mut metadata, gpt_oss_metadata(shape));
    }
    if let Some(t) = tokenizer {
        metadata.extend(t.metadata.iter().cloned());
    }
    metadata
}

/// The little-endian f16 bits of `v`.
fn f16_le(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Writes a tensor's data: norms from the synthetic norm grid, matrices as random blocks of their type.
fn write_tensor(out: &mut impl Write, t: &GgufTensor, rng: &mut SplitMix64) -> io::Result<()> {
    if t.dtype == TensorType::F32 {
        let table = match t.values {
            Values::Weight => ValueTable::new(WeightDType::F32, |k| k as f32 / 4096.0),
            Values::Large => ValueTable::new(WeightDType::F32, large_value),
            Values::Small => ValueTable::new(WeightDType::F32, small_value),
            Values::Norm | Values::NormMinusOne => ValueTable::new(WeightDType::F32, norm_value),
        };
        return table.write_random(out, t.dims.iter().product(), rng);
    }
    let block = t.dtype.type_size();
    let blocks = t.bytes() / block;
    // A few MiB at a time: random words, then each block's scales set in place.
    let per_chunk = ((4 << 20) / block).max(1);
    let mut buf = vec![0u8; per_chunk * block];
    let mut left = blocks;
    while left > 0 {
        let n = left.min(per_chunk);
        let bytes = &mut buf[..n * block];
        for word in bytes.chunks_mut(8) {
            let r = rng.next().to_le_bytes();
            word.copy_from_slice(&r[..word.len()]);
        }
        for b in bytes.chunks_exact_mut(block) {
            set_scales(t.dtype, b);
        }
        out.write_all(bytes)?;
        left -= n;
    }
    Ok(())
}

/// Overwrites the scale fields of one random block of `dtype` so that its weights have a standard deviation near
/// 0.02 ([`TARGET_STD`]) and no bias: the scale `d` takes a random factor in 1..2 from the block's own last byte
/// (so blocks differ), and a K-quant's sub-block minimums equal its scales, with `dmin` the unsigned values' mean
/// times `d`, so that each sub-block is centred.
fn set_scales(dtype: TensorType, b: &mut [u8]) {
    let jitter = (1.0 + f32::from(b[b.len() - 1]) / 256.0) / 1.5;
    let d_for = |value_std: f32| TARGET_STD / value_std * jitter;
    let dtype = match dtype {
        // 2^(e - 127) / 2 times a doubled FP4 value (rms 5.85): e = 120 gives std 0.023, 119 half that.
        TensorType::Mxfp4 => {
            b[0] = 119 + (b[b.len() - 1] & 1);
            return;
        }
        TensorType::Ggml(d) => d,
    };
    match dtype {
        // d * (q - 8), q in 0..16: std 4.6.
        GgmlDType::Q4_0 => b[..2].copy_from_slice(&f16_le(d_for(4.6))),
        // d * q, q an i8: std 74.
        GgmlDType::Q8_0 => b[..2].copy_from_slice(&f16_le(d_for(74.0))),
        // d * s * q - dmin * s, q in 0..16 (std 4.6, mean 7.5), s six bits (rms 36.5).
        GgmlDType::Q4K => {
            let d = d_for(4.6 * 36.5);
            b[..2].copy_from_slice(&f16_le(d));
            b[2..4].copy_from_slice(&f16_le(d * 7.5));
            equal_scales_and_mins(&mut b[4..16]);
        }
        // As Q4_K with q in 0..32 (std 9.2, mean 15.5).
        GgmlDType::Q5K => {
            let d = d_for(9.2 * 36.5);
            b[..2].copy_from_slice(&f16_le(d));
            b[2..4].copy_from_slice(&f16_le(d * 15.5));
            equal_scales_and_mins(&mut b[4..16]);
        }
        // ql[128] qh[64] scales[16] d: d * sc * (q - 32), q in 0..64 (std 18.5), sc an i8 kept in -16..16 (rms 9.2).
        GgmlDType::Q6K => {
            for s in &mut b[192..208] {
                *s = ((*s & 0x1f) as i8 - 16) as u8;
            }
            b[208..210].copy_from_slice(&f16_le(d_for(18.5 * 9.2)));
        }
        _ => {}
    }
}

/// What a synthetic weight's standard deviation is close to: the usual initialisation's.
const TARGET_STD: f32 = 0.02;

/// Repacks the twelve scale bytes of a Q4_K/Q5_K super-block so that each of its eight sub-blocks has its
/// minimum equal to its scale (six random bits each, from the bytes already there), in ggml's packing: sub-blocks
/// 0..4 in the low six bits of bytes 0..4 (scales) and 4..8 (minimums); 4..8 in the nibbles of bytes 8..12 with
/// their top two bits in the top bits of bytes 0..4 (scales) and 4..8 (minimums).
fn equal_scales_and_mins(bytes: &mut [u8]) {
    let s: [u8; 8] = std::array::from_fn(|j| bytes[j] & 63);
    for i in 0..4 {
        let high = (s[i + 4] >> 4) << 6;
        bytes[i] = s[i] | high;
        bytes[i + 4] = s[i] | high;
        bytes[i + 8] = (s[i + 4] & 0xf) | ((s[i + 4] & 0xf) << 4);
    }
}

#[cfg(test)]
#[path = "gguf_tests.rs"]
mod tests;

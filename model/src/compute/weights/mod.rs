//! Weight sources: read only the tensors asked for, from whichever file format the model came in.
//!
//! A node serving blocks 10..20 must never read the weights of blocks 0..10 or 20..30, so every source loads one
//! named tensor at a time (memory-mapped safetensors, seek-and-read GGUF and llama2.c) and records what it loaded in
//! a [`LoadLog`], which tests inspect.
mod gguf;
mod gguf_header;
mod llama2c;
mod safetensors;
mod shards;

pub(crate) use gguf::read_header as read_gguf_header;
pub use gguf::GgufWeights;
pub use llama2c::Llama2cWeights;
pub use safetensors::SafetensorsWeights;
pub use shards::{index_shards, ShardFetch};

use crate::compute::linear::{Linear, Mxfp4Matrix};
use crate::compute::placement::Placement;
use crate::error::Result;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use sha2::Sha256;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The tensors of one transformer block, named independently of the file format and the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockTensor {
    AttnNorm,
    Q,
    K,
    V,
    O,
    FfnNorm,
    Gate,
    Up,
    Down,
    /// Biases of the query/key/value projections (Qwen2).
    QBias,
    KBias,
    VBias,
    /// Per-head RMSNorm weights of queries and keys (Qwen3, Gemma 3).
    QNorm,
    KNorm,
    /// Norms of the attention's and the feed-forward's outputs (Gemma 2/3).
    PostAttnNorm,
    PostFfnNorm,
    /// Fused q/k/v and gate/up matrices (Phi-3).
    Qkv,
    GateUp,
    /// The mixture-of-experts router, `[experts, hidden]`.
    Router,
    /// Expert `e`'s SwiGLU matrices.
    ExpertGate(usize),
    ExpertUp(usize),
    ExpertDown(usize),
    /// The experts every token goes through (DeepSeek), one SwiGLU MLP.
    SharedGate,
    SharedUp,
    SharedDown,
    /// Per-expert bias of the scores used to choose experts (DeepSeek-V3), `[experts]`.
    ChoiceBias,
    /// gpt-oss: the router's bias `[experts]`, and expert `e`'s biases of its gate, up (`[expert_size]`) and down
    /// (`[hidden]`) projections.
    RouterBias,
    ExpertGateBias(usize),
    ExpertUpBias(usize),
    ExpertDownBias(usize),
    /// gpt-oss: the output projection's bias `[hidden]` and one sink logit per query head `[heads]`.
    OBias,
    Sinks,
    /// Latent attention (DeepSeek): the low-rank query projection (down, its norm, up), the projection to the
    /// latent and the rotated key `[kv_rank + rope_dim, hidden]`, the latent's norm, and the latent's expansion to
    /// every head's key (non-rotated part) and value `[heads * (nope_dim + value_dim), kv_rank]`. Without a
    /// low-rank query, `Q` is the query projection.
    QDown,
    QDownNorm,
    QUp,
    KvDown,
    KvDownNorm,
    KvUp,
    /// `KvUp` as llama.cpp's MLA files split it: each head's key expansion transposed, `[heads, kv_rank,
    /// nope_dim]`, and its value expansion, `[heads, value_dim, kv_rank]`.
    KeyUp,
    ValueUp,
}

/// How a family names its tensors in Hugging Face checkpoints, where that differs from Llama's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HfLayout {
    #[default]
    Llama,
    /// `pre_feedforward_layernorm` is the MLP's input norm, `post_attention_layernorm` the attention's output norm.
    Gemma,
    /// Experts under `block_sparse_moe` (`w1` gate, `w3` up, `w2` down).
    Mixtral,
    /// Every expert of a block in one tensor per matrix, gate and up interleaved and stored input-major
    /// (`mlp.experts.gate_up_proj` `[experts, hidden, 2 x size]`), under `mlp.router`.
    GptOss,
}

impl HfLayout {
    pub fn for_architecture(architecture: &str) -> Self {
        match architecture {
            "gemma2" | "gemma3" => Self::Gemma,
            "mixtral" => Self::Mixtral,
            "gpt_oss" => Self::GptOss,
            _ => Self::Llama,
        }
    }
}

/// The tensors outside the blocks, which only the client holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadTensor {
    Embed,
    FinalNorm,
    /// Absent when the model ties it to the embeddings.
    LmHead,
}

/// A loaded weight: dense, or still quantized as it was in the GGUF file.
#[derive(Debug, Clone)]
pub enum Weight {
    Dense(Tensor),
    Quantized(Arc<QTensor>),
    /// MXFP4 (gpt-oss's experts), a format candle does not know, repacked for our kernels as it is read.
    Mxfp4(Arc<Mxfp4Matrix>),
}

impl Weight {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Self::Dense(t) => t.dims().to_vec(),
            Self::Quantized(q) => q.shape().dims().to_vec(),
            Self::Mxfp4(m) => vec![m.rows(), m.cols()],
        }
    }

    /// A dense tensor at the placement (dequantizing if needed): norms and embeddings.
    pub fn dense(&self, p: &Placement) -> Result<Tensor> {
        match self {
            Self::Dense(t) => crate::compute::placement::normalise(t, p),
            Self::Quantized(q) => {
                crate::compute::placement::normalise(&q.dequantize(&p.device)?, p)
            }
            Self::Mxfp4(m) => {
                let values = Tensor::from_vec(m.dequantize(), (m.rows(), m.cols()), &p.device)?;
                crate::compute::placement::normalise(&values, p)
            }
        }
    }

    /// A norm's weight at the placement. `plus_one`: the file stores `w - 1` (Gemma's HF checkpoints), so the 1 is
    /// added here once, in f32 as the reference computes it, before the cast to the placement's dtype.
    pub fn norm(&self, p: &Placement, plus_one: bool) -> Result<Tensor> {
        if !plus_one {
            return self.dense(p);
        }
        let f = self.dense(&Placement::new(p.device.clone(), DType::F32))?;
        crate::compute::placement::normalise(&(f + 1.0)?, p)
    }

    /// A matmul weight. Quantized weights stay quantized when the block computes in f32 (quantized kernels take
    /// f32 activations); for f16/bf16 blocks they are dequantized to the block's dtype.
    pub fn matmul(&self, p: &Placement) -> Result<Linear> {
        match self {
            Self::Quantized(q) if p.dtype == DType::F32 => Linear::quantized(q.clone(), &p.device),
            Self::Mxfp4(m) if p.dtype == DType::F32 && p.device.is_cpu() => {
                Ok(Linear::Mxfp4(m.clone()))
            }
            other => Ok(Linear::dense(other.dense(p)?)),
        }
    }
}

/// What a source has loaded so far: names and bytes. Tests use it to prove a span reads only its own blocks.
#[derive(Debug, Default)]
pub struct LoadLog {
    names: Mutex<Vec<String>>,
    bytes: AtomicU64,
}

impl LoadLog {
    pub(crate) fn record(&self, name: &str, bytes: usize) {
        if let Ok(mut names) = self.names.lock() {
            names.push(name.to_string());
        }
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Format-specific names of every tensor loaded, in order.
    pub fn names(&self) -> Vec<String> {
        self.names.lock().map(|n| n.clone()).unwrap_or_default()
    }

    /// Bytes of tensor data read from the files.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// A model's weights in one file format.
pub trait WeightSource: Send + Sync {
    fn load_block(&self, block: usize, t: BlockTensor, device: &Device) -> Result<Weight>;
    /// `Ok(None)` when the tensor is legitimately absent (a tied LM head).
    fn load_head(&self, t: HeadTensor, device: &Device) -> Result<Option<Weight>>;
    /// The block index a format-specific tensor name belongs to, if any (tests map the load log back to blocks).
    fn block_of(&self, name: &str) -> Option<usize>;
    fn log(&self) -> &LoadLog;
    /// "none" for dense weights, else the dominant quantization ("q4_1").
    fn quantization(&self) -> String;
    /// Feeds the tensor index and a small sample of every tensor's bytes into the model fingerprint.
    fn fingerprint(&self, hasher: &mut Sha256) -> Result<()>;
    /// Feeds every byte of block `block`'s tensors (names, dtypes, shapes and data, in name order) into `hasher`:
    /// the block's exact identity, read from this block's tensors only.
    fn hash_block(&self, block: usize, hasher: &mut Sha256) -> Result<()>;
    /// Block `block`'s tensors as the file stores them, from the header alone; `None` where the format does not
    /// say without reading more (safetensors shards a hub model has not fetched yet).
    fn block_stored(&self, _block: usize) -> Option<Vec<StoredTensor>> {
        None
    }
}

/// One tensor as a file stores it: what a memory budget needs to know before anything is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredTensor {
    pub elements: u64,
    pub bytes: u64,
    /// Quantized (GGUF's block formats), rather than a float dtype.
    pub quantized: bool,
}

impl StoredTensor {
    /// Bytes once loaded into blocks computing in `dtype`: quantized tensors stay as stored in f32 blocks
    /// ([`Weight::matmul`]); everything else is held in `dtype`.
    pub fn loaded_bytes(&self, dtype: DType) -> u64 {
        if self.quantized && dtype == DType::F32 {
            self.bytes
        } else {
            self.elements * dtype.size_in_bytes() as u64
        }
    }
}

/// Feeds `len` bytes of `file` from `start` into `hasher`, a MiB at a time.
pub(crate) fn hash_file_range(
    file: &mut std::fs::File,
    path: &std::path::Path,
    start: u64,
    len: u64,
    hasher: &mut Sha256,
) -> Result<()> {
    use sha2::Digest;
    use std::io::{Read, Seek, SeekFrom};
    file.seek(SeekFrom::Start(start))
        .map_err(|e| crate::ModelError::io(path, e))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        file.read_exact(&mut buf[..n])
            .map_err(|e| crate::ModelError::io(path, e))?;
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(())
}

/// Bytes of each tensor sampled into the fingerprint, at its start and its middle: enough to tell two fine-tunes of
/// one architecture apart without reading whole tensors (a node must not read other blocks' weights).
pub(crate) const FINGERPRINT_SAMPLE: usize = 64;

pub(crate) fn sample_ranges(offset: u64, len: u64) -> [(u64, u64); 2] {
    let n = (FINGERPRINT_SAMPLE as u64).min(len);
    let mid = offset + len / 2;
    let mid_n = n.min(offset + len - mid);
    [(offset, n), (mid, mid_n)]
}

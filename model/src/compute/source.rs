//! Opening a model from disk: detect the format, read its description, and hand out spans and heads that read only
//! their own tensors.
use crate::compute::block_range::BlockRange;
use crate::compute::deepseek_gguf::deepseek2_options;
use crate::compute::family::{Activation, FamilyOptions, Moe, SlidingWindow, Yarn};
use crate::compute::hash_cache::HashCache;
use crate::compute::head::Head;
use crate::compute::placement::Placement;
use crate::compute::span::BlockSpan;
use crate::compute::spec::{ModelSpec, RopeStyle};
use crate::compute::weights::{
    GgufWeights, HfLayout, Llama2cWeights, LoadLog, SafetensorsWeights, ShardFetch, WeightSource,
};
use crate::error::{ModelError, Result};
use crate::hub::HubIdentity;
use crate::text::tokenizer::Tokenizer;
use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// A Hugging Face directory (config.json + safetensors), or one .safetensors file inside one.
    HuggingFace,
    Gguf,
    /// Karpathy's llama2.c checkpoint.
    Llama2c,
}

/// An opened model: its description, its format and a lazily-read weight source.
pub struct ModelSource {
    path: PathBuf,
    format: ModelFormat,
    spec: Arc<ModelSpec>,
    weights: Box<dyn WeightSource>,
    model_id: OnceLock<String>,
    /// Every block's hash ([`ModelSource::block_hash`]), computed on first use.
    manifest: OnceLock<Arc<Vec<String>>>,
    /// Where block hashes are cached across runs ([`HashCache`]); `None`: not cached.
    hash_cache_dir: Option<PathBuf>,
    /// Set for a model opened from the Hugging Face hub: the revision it is pinned to ([`crate::hub`]).
    hub: Option<HubIdentity>,
}

impl std::fmt::Debug for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSource")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("spec", &self.spec)
            .finish()
    }
}

impl ModelSource {
    /// Opens `path`, reading headers and config only; no weights are read until a span or head is loaded.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_fetching(path.as_ref(), None)
    }

    /// [`ModelSource::open`]; with `fetch`, the shards a safetensors index names are fetched when first read
    /// instead of having to be on disk (hub models: [`crate::hub::open`]).
    pub fn open_fetching(path: &Path, fetch: Option<ShardFetch>) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::NotFound(path.to_path_buf()));
        }
        let format = detect_format(path)?;
        let name = model_name(path);
        let (spec, weights): (ModelSpec, Box<dyn WeightSource>) = match format {
            ModelFormat::HuggingFace => {
                let dir = if path.is_dir() {
                    path.to_path_buf()
                } else {
                    path.parent().map(Path::to_path_buf).unwrap_or_default()
                };
                let config = dir.join("config.json");
                let json =
                    std::fs::read_to_string(&config).map_err(|e| ModelError::io(&config, e))?;
                let spec = ModelSpec::from_hf_config(&name, &json)?;
                let layout = HfLayout::for_architecture(&spec.architecture);
                (
                    spec,
                    Box::new(SafetensorsWeights::open_fetching(path, fetch)?.with_layout(layout)),
                )
            }
            ModelFormat::Gguf => {
                let w = GgufWeights::open(path)?;
                (gguf_spec(&name, &w)?, Box::new(w))
            }
            ModelFormat::Llama2c => {
                let w = Llama2cWeights::open(path)?;
                (w.spec(&name)?, Box::new(w))
            }
        };
        tracing::info!(path = %path.display(), ?format, blocks = spec.num_blocks, "opened model");
        Ok(Self {
            path: path.to_path_buf(),
            format,
            spec: Arc::new(spec),
            weights,
            model_id: OnceLock::new(),
            manifest: OnceLock::new(),
            hash_cache_dir: HashCache::default_dir(),
            hub: None,
        })
    }

    /// This model as opened from the hub at `identity`'s revision: named after the repository, identified by the
    /// revision ([`ModelSource::model_id`]).
    pub(crate) fn pinned_to(mut self, identity: HubIdentity) -> Self {
        let mut spec = (*self.spec).clone();
        spec.name = identity.repo.clone();
        self.spec = Arc::new(spec);
        self.hub = Some(identity);
        self
    }

    /// The hub revision this model was opened from; `None` for a local path.
    pub fn hub(&self) -> Option<&HubIdentity> {
        self.hub.as_ref()
    }

    /// Whether every weight file is on disk, so that every block can be hashed without a download: always for a
    /// local path; for a hub model once every shard has been fetched (a client holding only the head's shards
    /// trusts the revision pin of the model id instead of checking servers' block hashes).
    pub fn has_all_weights(&self) -> bool {
        self.hub
            .as_ref()
            .is_none_or(|h| h.weight_files.iter().all(|f| f.is_file()))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn format(&self) -> ModelFormat {
        self.format
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn spec_arc(&self) -> Arc<ModelSpec> {
        self.spec.clone()
    }

    pub fn weights(&self) -> &dyn WeightSource {
        self.weights.as_ref()
    }

    /// Names and bytes of every tensor loaded so far.
    pub fn load_log(&self) -> &LoadLog {
        self.weights.log()
    }

    pub fn quantization(&self) -> String {
        self.weights.quantization()
    }

    /// Fingerprint of the exact weights: `<name>-<32 hex>`, from the description, the tensor index and a sample of
    /// every tensor; for a hub model, from the description, the resolved commit and the index (or the weight
    /// file's name), so that every peer of one revision agrees without reading weights it does not load. Servers
    /// announce spans under it; a client chains only spans of its own id.
    pub fn model_id(&self) -> Result<String> {
        if let Some(id) = self.model_id.get() {
            return Ok(id.clone());
        }
        let mut h = Sha256::new();
        h.update(serde_json::to_vec(&*self.spec).map_err(|e| ModelError::Config(e.to_string()))?);
        match &self.hub {
            // A hub model may be partly downloaded: the commit pins the bytes instead of a sample of them.
            Some(hub) => {
                h.update(hub.commit.as_bytes());
                h.update(hub.layout.as_bytes());
            }
            None => self.weights.fingerprint(&mut h)?,
        }
        let digest = hex::encode(h.finalize());
        let name: String = self
            .spec
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let id = format!("{name}-{}", &digest[..32]);
        Ok(self.model_id.get_or_init(|| id).clone())
    }

    /// SHA-256 (hex) of every byte of block `block`'s weights, read from that block's tensors only. The model id
    /// samples the weights; these hashes pin them exactly: a server announces the hashes of the blocks it serves
    /// and a client chains it only if they equal its own model's.
    pub fn block_hash(&self, block: usize) -> Result<String> {
        if block >= self.spec.num_blocks {
            return Err(ModelError::Config(format!(
                "block {block} is outside the model's {} blocks",
                self.spec.num_blocks
            )));
        }
        let mut h = Sha256::new();
        h.update(b"petal-block-v1");
        self.weights.hash_block(block, &mut h)?;
        Ok(hex::encode(h.finalize()))
    }

    /// The hashes of blocks `range`, in order: from the disk cache where it has them ([`HashCache`]), else read
    /// and hashed, and cached.
    pub fn block_hashes(&self, range: BlockRange) -> Result<Vec<String>> {
        range.validate(self.spec.num_blocks)?;
        let cache = match &self.hash_cache_dir {
            Some(dir) => Some(HashCache::for_model(
                dir,
                &self.model_id()?,
                &self.weight_files()?,
            )?),
            None => None,
        };
        let mut known = cache.as_ref().map(HashCache::load).unwrap_or_default();
        let missing: Vec<usize> = (range.start..range.end)
            .filter(|b| !known.contains_key(b))
            .collect();
        for &b in &missing {
            known.insert(b, self.block_hash(b)?);
        }
        if let (Some(cache), false) = (&cache, missing.is_empty()) {
            cache.store(&known);
        }
        Ok((range.start..range.end)
            .filter_map(|b| known.remove(&b))
            .collect())
    }

    /// Caches block hashes under `dir` instead of the default directory ([`HashCache::default_dir`]); `None`
    /// turns the cache off.
    pub fn set_hash_cache(&mut self, dir: Option<PathBuf>) {
        self.hash_cache_dir = dir;
    }

    /// The files the weights are read from: the model file, or a directory's safetensors files.
    pub fn weight_files(&self) -> Result<Vec<PathBuf>> {
        if !self.path.is_dir() {
            return Ok(vec![self.path.clone()]);
        }
        let entries = std::fs::read_dir(&self.path).map_err(|e| ModelError::io(&self.path, e))?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        Ok(files)
    }

    /// Every block's hash: what a client checks servers' announcements against. Reads the whole model once.
    pub fn manifest(&self) -> Result<Arc<Vec<String>>> {
        if let Some(m) = self.manifest.get() {
            return Ok(m.clone());
        }
        let all = Arc::new(self.block_hashes(BlockRange::new(0, self.spec.num_blocks))?);
        Ok(self.manifest.get_or_init(|| all).clone())
    }

    /// Loads blocks `range`, block `range.start + i` onto `placements[i]`.
    pub fn load_span(&self, range: BlockRange, placements: &[Placement]) -> Result<BlockSpan> {
        range.validate(self.spec.num_blocks)?;
        BlockSpan::load(self.weights.as_ref(), self.spec.clone(), range, placements)
    }

    /// [`ModelSource::load_span`], calling `on_block(i)` after each block `i` is loaded (progress bars).
    pub fn load_span_with_progress(
        &self,
        range: BlockRange,
        placements: &[Placement],
        on_block: impl FnMut(usize),
    ) -> Result<BlockSpan> {
        range.validate(self.spec.num_blocks)?;
        BlockSpan::load_with_progress(
            self.weights.as_ref(),
            self.spec.clone(),
            range,
            placements,
            on_block,
        )
    }

    /// Loads blocks `range` all onto one placement.
    pub fn load_span_on(&self, range: BlockRange, placement: &Placement) -> Result<BlockSpan> {
        self.load_span(range, &vec![placement.clone(); range.len()])
    }

    /// The dtype this model's blocks compute in when `asked` for one (`None`: the default). The one place this rule
    /// lives: GGUF blocks keep their quantized weights (and compute in f32) unless f16/bf16 is asked, which
    /// dequantizes them into that dtype; other formats compute in the asked dtype, f32 by default.
    pub fn block_dtype(&self, asked: Option<DType>) -> DType {
        match (self.format, asked) {
            (_, None) => DType::F32,
            (ModelFormat::Gguf, Some(DType::F16 | DType::BF16)) => asked.unwrap_or(DType::F32),
            (ModelFormat::Gguf, Some(_)) => DType::F32,
            (_, Some(d)) => d,
        }
    }

    /// Bytes block `block`'s weights take once loaded into blocks computing in `dtype`, known before anything is
    /// read: exact from a GGUF header (its quantized tensors stay as stored), else the spec's parameters (matrices
    /// and norms) in `dtype`.
    pub fn block_weight_bytes(&self, block: usize, dtype: DType) -> u64 {
        match self.weights.block_stored(block) {
            Some(tensors) => tensors.iter().map(|t| t.loaded_bytes(dtype)).sum(),
            None => {
                let norms = 2 * self.spec.hidden_size as u64;
                (self.spec.block_parameters(block) + norms) * dtype.size_in_bytes() as u64
            }
        }
    }

    /// Where blocks of this model run on `device` when `asked` for a dtype: see [`ModelSource::block_dtype`].
    pub fn block_placement(&self, device: &Device, asked: Option<DType>) -> Placement {
        Placement::new(device.clone(), self.block_dtype(asked))
    }

    /// Loads embeddings, final norm and LM head, and nothing else.
    pub fn load_head(&self, placement: Placement) -> Result<Head> {
        Head::load(self.weights.as_ref(), &self.spec, placement)
    }

    pub fn tokenizer(&self, override_path: Option<&Path>) -> Result<Tokenizer> {
        Tokenizer::for_model(&self.path, override_path)
    }
}

fn model_name(path: &Path) -> String {
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    let name = stem
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    // An `hf/` directory says nothing; name it after its parent.
    if name == "hf" {
        if let Some(parent) = path.parent().and_then(|p| p.file_name()) {
            return parent.to_string_lossy().into_owned();
        }
    }
    name
}

fn detect_format(path: &Path) -> Result<ModelFormat> {
    if path.is_dir() {
        let has = |f: &str| path.join(f).exists();
        if has("config.json") && (has("model.safetensors") || has("model.safetensors.index.json")) {
            return Ok(ModelFormat::HuggingFace);
        }
        return Err(ModelError::UnknownFormat(path.to_path_buf()));
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let mut magic = [0u8; 4];
    let has_gguf_magic = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .map(|_| &magic == b"GGUF")
        .unwrap_or(false);
    match ext.as_str() {
        "gguf" => Ok(ModelFormat::Gguf),
        _ if has_gguf_magic => Ok(ModelFormat::Gguf),
        "safetensors" => Ok(ModelFormat::HuggingFace),
        "bin" => Ok(ModelFormat::Llama2c),
        _ => Err(ModelError::UnknownFormat(path.to_path_buf())),
    }
}

/// The description of a GGUF model from its metadata (llama.cpp's key names, under the architecture's prefix).
fn gguf_spec(name: &str, w: &GgufWeights) -> Result<ModelSpec> {
    let md = w.metadata();
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    if !matches!(
        arch.as_str(),
        "llama"
            | "qwen2"
            | "qwen3"
            | "qwen3moe"
            | "phi3"
            | "gemma2"
            | "gemma3"
            | "deepseek2"
            | "gpt-oss"
    ) {
        return Err(ModelError::UnknownArchitecture(arch));
    }
    let get = |key: &str| md.get(&format!("{arch}.{key}"));
    let need_u32 = |key: &str| -> Result<usize> {
        get(key)
            .and_then(|v| v.to_u32().ok())
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::Config(format!("GGUF metadata lacks {arch}.{key}")))
    };
    let f32_opt = |key: &str| get(key).and_then(|v| v.to_f32().ok());
    let f32_or = |key: &str, default: f32| f32_opt(key).unwrap_or(default);
    let blocks = need_u32("block_count")?;
    let deepseek = (arch == "deepseek2")
        .then(|| deepseek2_options(md, |t| w.has_tensor(t), blocks))
        .transpose()?;
    let moe = match &deepseek {
        Some(d) => d.moe.clone(),
        None => gguf_moe(
            &arch,
            &need_u32,
            |b| w.has_tensor(&format!("blk.{b}.ffn_gate_inp.weight")),
            blocks,
        )?,
    };
    let hidden = need_u32("embedding_length")?;
    let heads = need_u32("attention.head_count")?;
    let head_dim = match &deepseek {
        Some(d) => Ok(d.latent.query_dim()),
        None => need_u32("attention.key_length")
            .or_else(|_| need_u32("rope.dimension_count"))
            .or_else(|_| {
                hidden
                    .checked_div(heads)
                    .ok_or_else(|| ModelError::Config("head_count is 0".into()))
            }),
    }?;
    let vocab = match w.tensor_dims("token_embd.weight") {
        Some(d) if d.len() == 2 => d[0],
        _ => {
            return Err(ModelError::MissingTensor {
                name: "token_embd.weight".into(),
            })
        }
    };
    let gemma = arch.starts_with("gemma");
    let gpt_oss = arch == "gpt-oss";
    let window = need_u32("attention.sliding_window").ok().filter(|&w| w > 0);
    // Which layers llama.cpp windows: Gemma 2 the even ones, Gemma 3 five in six, Phi-3 all when set.
    let windowed: Vec<usize> = match arch.as_str() {
        "gemma2" | "gpt-oss" => (0..blocks).filter(|i| i % 2 == 0).collect(),
        "gemma3" => {
            let n = need_u32("attention.sliding_window_type")
                .unwrap_or(6)
                .max(1);
            (0..blocks).filter(|i| (i + 1) % n != 0).collect()
        }
        "phi3" => (0..blocks).collect(),
        _ => vec![],
    };
    let options = FamilyOptions {
        qkv_bias: w.has_tensor("blk.0.attn_q.bias"),
        qk_norm: w.has_tensor("blk.0.attn_q_norm.weight"),
        // llama.cpp's converter adds Gemma's 1 to its norm weights.
        norm_plus_one: false,
        activation: if gemma {
            Activation::GeluTanh
        } else if gpt_oss {
            // llama.cpp's constants for gpt-oss (no key holds them).
            Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            }
        } else {
            Activation::Silu
        },
        sandwich_norms: gemma,
        scale_embeddings: gemma,
        // Gemma 2 27B scales by hidden / heads (its query_pre_attn_scalar); the others by the head size.
        query_pre_attn_scalar: (arch == "gemma2" && blocks == 46).then(|| (hidden / heads) as f64),
        attn_softcap: f32_opt("attn_logit_softcapping").map(f64::from),
        final_softcap: f32_opt("final_logit_softcapping").map(f64::from),
        sliding_window: window
            .filter(|_| !windowed.is_empty())
            .map(|size| SlidingWindow {
                size,
                layers: windowed,
            }),
        local_rope_theta: (arch == "gemma3").then(|| f32_or("rope.local_freq_base", 10_000.0)),
        rope_linear_factor: match get("rope.scaling.type").and_then(|v| v.to_string().ok()) {
            Some(t) if t == "linear" => f32_opt("rope.scaling.factor"),
            _ => None,
        },
        fused_projections: arch == "phi3",
        moe,
        latent_attention: deepseek.as_ref().map(|d| d.latent),
        yarn: match &deepseek {
            Some(d) => d.yarn,
            None => gguf_yarn(&|k| get(k).cloned())?,
        },
        attention_sinks: w.has_tensor("blk.0.attn_sinks.weight"),
        output_bias: w.has_tensor("blk.0.attn_output.bias"),
    };
    let token_id = |key: &str| md.get(key).and_then(|v: &Value| v.to_u32().ok());
    let spec = ModelSpec {
        name: name.to_string(),
        num_blocks: blocks,
        hidden_size: hidden,
        // Qwen3-MoE files may leave out the dense width: no layer of theirs has one.
        intermediate_size: need_u32("feed_forward_length")
            .or_else(|e| options.moe.as_ref().map(|m| m.expert_size).ok_or(e))?,
        num_heads: heads,
        // Latent attention caches one latent for all heads (llama.cpp's MLA files say so too; older ones do not).
        num_kv_heads: if deepseek.is_some() {
            1
        } else {
            need_u32("attention.head_count_kv").unwrap_or(heads)
        },
        head_dim,
        vocab_size: vocab,
        rope_theta: f32_or("rope.freq_base", 10_000.0),
        rope_scaling: None,
        // llama.cpp permutes Llama's q/k rows to Meta's interleaved pairs (DeepSeek's are so already); the other
        // families keep rotate-half.
        rope_style: if arch == "llama" || arch == "deepseek2" {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Half
        },
        rms_eps: f32_or("attention.layer_norm_rms_epsilon", 1e-5) as f64,
        max_position: need_u32("context_length").unwrap_or(4096),
        tie_embeddings: !w.has_tensor("output.weight"),
        bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: token_id("tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
        options,
        architecture: arch,
    };
    spec.validate()?;
    Ok(spec)
}

/// The mixture of experts a GGUF file's metadata describes, if any: Mixtral is written as `llama` with an
/// expert count, Qwen3-MoE as `qwen3moe`. llama.cpp renormalises the chosen experts' weights in both (its
/// `qwen3moe` graph always does, whatever the HF config said). A layer without a router keeps a dense MLP.
fn gguf_moe(
    arch: &str,
    need_u32: &dyn Fn(&str) -> Result<usize>,
    has_router: impl Fn(usize) -> bool,
    blocks: usize,
) -> Result<Option<Moe>> {
    let experts = need_u32("expert_count").unwrap_or(0);
    if experts == 0 {
        if arch == "qwen3moe" {
            return Err(ModelError::Config(
                "GGUF metadata lacks qwen3moe.expert_count".into(),
            ));
        }
        return Ok(None);
    }
    let expert_size = match arch {
        "qwen3moe" | "gpt-oss" => need_u32("expert_feed_forward_length")?,
        _ => need_u32("feed_forward_length")?,
    };
    Ok(Some(Moe {
        num_experts: experts,
        experts_per_token: need_u32("expert_used_count")?,
        normalize_top_k: true,
        expert_size,
        dense_layers: (0..blocks).filter(|&b| !has_router(b)).collect(),
        // gpt-oss's softmax over its best experts' logits equals the renormalised softmax over all of them.
        biases: arch == "gpt-oss",
        ..Moe::default()
    }))
}

/// YaRN from the common keys (`rope.scaling.type` = `yarn`; gpt-oss): llama.cpp scales the tables by
/// `1 + 0.1 ln(factor)` (`mscale` 1 over `mscale_all_dim` 0 here) and always rounds the band outwards.
fn gguf_yarn(get: &dyn Fn(&str) -> Option<Value>) -> Result<Option<Yarn>> {
    let f32_of = |k: &str| get(k).and_then(|v| v.to_f32().ok());
    match get("rope.scaling.type").and_then(|v| v.to_string().ok().cloned()) {
        Some(t) if t == "yarn" => Ok(Some(Yarn {
            factor: f32_of("rope.scaling.factor").unwrap_or(1.0),
            original_max_position: get("rope.scaling.original_context_length")
                .and_then(|v| v.to_u32().ok())
                .ok_or_else(|| {
                    ModelError::Config(
                        "GGUF YaRN lacks rope.scaling.original_context_length".into(),
                    )
                })? as usize,
            beta_fast: f32_of("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
            beta_slow: f32_of("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
            mscale: 1.0,
            mscale_all_dim: 0.0,
            truncate: true,
        })),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod progress_tests {
    use super::*;

    #[test]
    fn load_span_with_progress_reports_each_block_once_in_order() {
        let path = crate::models_dir::find_model("stories260K/stories260K.bin")
            .expect("the shared stories260K model");
        let source = ModelSource::open(path).unwrap();
        let range = BlockRange::new(1, 4);
        let mut seen = vec![];
        let span = source
            .load_span_with_progress(range, &vec![Placement::cpu_f32(); 3], |i| seen.push(i))
            .unwrap();
        assert_eq!(seen, vec![1, 2, 3]);
        assert_eq!(span.range(), range);
        // A bad range fails before any block is loaded or reported.
        let mut called = false;
        let bad = source.load_span_with_progress(BlockRange::new(3, 9), &[], |_| called = true);
        assert!(bad.is_err() && !called);
    }
}

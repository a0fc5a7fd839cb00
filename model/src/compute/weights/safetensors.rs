//! Hugging Face safetensors, one file or sharded (`model.safetensors.index.json`), memory-mapped: a tensor's pages
//! are touched only when it is loaded.
use super::shards::{ShardFetch, Shards};
use super::{BlockTensor, HeadTensor, HfLayout, LoadLog, Weight, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::Device;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub struct SafetensorsWeights {
    files: Vec<PathBuf>,
    st: Shards,
    log: LoadLog,
    layout: HfLayout,
}

impl SafetensorsWeights {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`, or one file.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_fetching(path, None)
    }

    /// [`SafetensorsWeights::open`]; with `fetch`, the shards of an index need not be on disk yet: each is
    /// fetched and opened when a tensor in it is first read (a hub model's node and client).
    pub fn open_fetching(path: &Path, fetch: Option<ShardFetch>) -> Result<Self> {
        let index = path.join("model.safetensors.index.json");
        let st = if path.is_file() {
            Shards::single(path)?
        } else if index.exists() {
            Shards::indexed(path, &index, fetch)?
        } else {
            let single = path.join("model.safetensors");
            if !single.exists() {
                return Err(ModelError::NotFound(single));
            }
            Shards::single(&single)?
        };
        Ok(Self {
            files: st.files(),
            st,
            log: LoadLog::default(),
            layout: HfLayout::Llama,
        })
    }

    /// Names block tensors the way `layout`'s family does (Llama's until set).
    pub fn with_layout(mut self, layout: HfLayout) -> Self {
        self.layout = layout;
        self
    }

    fn load(&self, name: &str, device: &Device) -> Result<Weight> {
        let bytes = self.st.get(name)?.data().len();
        let t = self.st.load(name, device)?;
        self.log.record(name, bytes);
        Ok(Weight::Dense(t))
    }

    fn has(&self, name: &str) -> bool {
        self.st.contains(name)
    }
}

pub(crate) fn hf_block_name(layout: HfLayout, block: usize, t: BlockTensor) -> String {
    let gemma = layout == HfLayout::Gemma;
    let leaf = match t {
        BlockTensor::AttnNorm => "input_layernorm.weight".to_string(),
        BlockTensor::Q => "self_attn.q_proj.weight".into(),
        BlockTensor::K => "self_attn.k_proj.weight".into(),
        BlockTensor::V => "self_attn.v_proj.weight".into(),
        BlockTensor::O => "self_attn.o_proj.weight".into(),
        BlockTensor::FfnNorm if gemma => "pre_feedforward_layernorm.weight".into(),
        BlockTensor::FfnNorm | BlockTensor::PostAttnNorm => {
            "post_attention_layernorm.weight".into()
        }
        BlockTensor::PostFfnNorm => "post_feedforward_layernorm.weight".into(),
        BlockTensor::Gate => "mlp.gate_proj.weight".into(),
        BlockTensor::Up => "mlp.up_proj.weight".into(),
        BlockTensor::Down => "mlp.down_proj.weight".into(),
        BlockTensor::QBias => "self_attn.q_proj.bias".into(),
        BlockTensor::KBias => "self_attn.k_proj.bias".into(),
        BlockTensor::VBias => "self_attn.v_proj.bias".into(),
        BlockTensor::QNorm => "self_attn.q_norm.weight".into(),
        BlockTensor::KNorm => "self_attn.k_norm.weight".into(),
        BlockTensor::Qkv => "self_attn.qkv_proj.weight".into(),
        BlockTensor::GateUp => "mlp.gate_up_proj.weight".into(),
        BlockTensor::Router if layout == HfLayout::Mixtral => "block_sparse_moe.gate.weight".into(),
        BlockTensor::Router => "mlp.gate.weight".into(),
        BlockTensor::ExpertGate(e) | BlockTensor::ExpertUp(e) | BlockTensor::ExpertDown(e)
            if layout == HfLayout::Mixtral =>
        {
            let w = match t {
                BlockTensor::ExpertGate(_) => "w1",
                BlockTensor::ExpertUp(_) => "w3",
                _ => "w2",
            };
            format!("block_sparse_moe.experts.{e}.{w}.weight")
        }
        BlockTensor::ExpertGate(e) => format!("mlp.experts.{e}.gate_proj.weight"),
        BlockTensor::ExpertUp(e) => format!("mlp.experts.{e}.up_proj.weight"),
        BlockTensor::ExpertDown(e) => format!("mlp.experts.{e}.down_proj.weight"),
        BlockTensor::SharedGate => "mlp.shared_experts.gate_proj.weight".into(),
        BlockTensor::SharedUp => "mlp.shared_experts.up_proj.weight".into(),
        BlockTensor::SharedDown => "mlp.shared_experts.down_proj.weight".into(),
        BlockTensor::RouterBias => "mlp.gate.e_score_correction_bias".into(),
        BlockTensor::QDown => "self_attn.q_a_proj.weight".into(),
        BlockTensor::QDownNorm => "self_attn.q_a_layernorm.weight".into(),
        BlockTensor::QUp => "self_attn.q_b_proj.weight".into(),
        BlockTensor::KvDown => "self_attn.kv_a_proj_with_mqa.weight".into(),
        BlockTensor::KvDownNorm => "self_attn.kv_a_layernorm.weight".into(),
        BlockTensor::KvUp => "self_attn.kv_b_proj.weight".into(),
        BlockTensor::KeyUp => "self_attn.k_b_proj.weight".into(),
        BlockTensor::ValueUp => "self_attn.v_b_proj.weight".into(),
    };
    format!("model.layers.{block}.{leaf}")
}

impl WeightSource for SafetensorsWeights {
    fn load_block(&self, block: usize, t: BlockTensor, device: &Device) -> Result<Weight> {
        self.load(&hf_block_name(self.layout, block, t), device)
    }

    fn load_head(&self, t: HeadTensor, device: &Device) -> Result<Option<Weight>> {
        let name = match t {
            HeadTensor::Embed => "model.embed_tokens.weight",
            HeadTensor::FinalNorm => "model.norm.weight",
            HeadTensor::LmHead if !self.has("lm_head.weight") => return Ok(None),
            HeadTensor::LmHead => "lm_head.weight",
        };
        self.load(name, device).map(Some)
    }

    fn block_of(&self, name: &str) -> Option<usize> {
        name.strip_prefix("model.layers.")?
            .split('.')
            .next()?
            .parse()
            .ok()
    }

    fn log(&self) -> &LoadLog {
        &self.log
    }

    fn quantization(&self) -> String {
        "none".into()
    }

    fn hash_block(&self, block: usize, hasher: &mut Sha256) -> Result<()> {
        let mut tensors = self
            .st
            .tensors_where(|name| self.block_of(name) == Some(block))?;
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, view) in tensors {
            hasher.update(name.as_bytes());
            hasher.update(format!("{:?}{:?}", view.dtype(), view.shape()).as_bytes());
            hasher.update(view.data());
        }
        Ok(())
    }

    fn fingerprint(&self, hasher: &mut Sha256) -> Result<()> {
        let mut tensors = self.st.tensors()?;
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, view) in tensors {
            hasher.update(name.as_bytes());
            hasher.update(format!("{:?}{:?}", view.dtype(), view.shape()).as_bytes());
            let data = view.data();
            for (start, len) in super::sample_ranges(0, data.len() as u64) {
                hasher.update(&data[start as usize..(start + len) as usize]);
            }
        }
        hasher.update(format!("{} files", self.files.len()).as_bytes());
        Ok(())
    }
}

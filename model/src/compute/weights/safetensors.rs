//! Hugging Face safetensors, one file or sharded (`model.safetensors.index.json`), memory-mapped: a tensor's pages
//! are touched only when it is loaded.
use super::shards::{ShardFetch, Shards};
use super::{BlockTensor, HeadTensor, LoadLog, Weight, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::Device;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub struct SafetensorsWeights {
    files: Vec<PathBuf>,
    st: Shards,
    log: LoadLog,
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
        })
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

pub(crate) fn hf_block_name(block: usize, t: BlockTensor) -> String {
    let leaf = match t {
        BlockTensor::AttnNorm => "input_layernorm",
        BlockTensor::Q => "self_attn.q_proj",
        BlockTensor::K => "self_attn.k_proj",
        BlockTensor::V => "self_attn.v_proj",
        BlockTensor::O => "self_attn.o_proj",
        BlockTensor::FfnNorm => "post_attention_layernorm",
        BlockTensor::Gate => "mlp.gate_proj",
        BlockTensor::Up => "mlp.up_proj",
        BlockTensor::Down => "mlp.down_proj",
    };
    format!("model.layers.{block}.{leaf}.weight")
}

impl WeightSource for SafetensorsWeights {
    fn load_block(&self, block: usize, t: BlockTensor, device: &Device) -> Result<Weight> {
        self.load(&hf_block_name(block, t), device)
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

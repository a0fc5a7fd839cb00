//! GGUF files: the header is parsed once; each tensor is read with one seek and one read of exactly its bytes, and
//! stays quantized.
use super::{BlockTensor, HeadTensor, LoadLog, StoredTensor, Weight, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::Device;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The header (metadata and tensor index) of a GGUF file, read through a buffer: candle's parser reads each
/// string, length and array element on its own, so unbuffered a vocabulary of 49 152 tokens with as many merges
/// (SmolLM2's) took some 250 000 `read` calls, a quarter of a second of system time, every time the file was
/// opened. The file's position afterwards is wherever the buffer left it: tensors are read at their offsets.
pub(crate) fn read_header(file: &mut File) -> candle_core::Result<Content> {
    Content::read(&mut std::io::BufReader::new(file))
}

pub struct GgufWeights {
    path: PathBuf,
    content: Content,
    file: Mutex<File>,
    log: LoadLog,
}

impl GgufWeights {
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let content = read_header(&mut file).map_err(|e| ModelError::Corrupt {
            format: "GGUF",
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            file: Mutex::new(file),
            log: LoadLog::default(),
        })
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn tensor_dims(&self, name: &str) -> Option<Vec<usize>> {
        self.content
            .tensor_infos
            .get(name)
            .map(|i| i.shape.dims().to_vec())
    }

    fn file(&self) -> Result<std::sync::MutexGuard<'_, File>> {
        self.file
            .lock()
            .map_err(|_| ModelError::Config("GGUF reader poisoned by an earlier panic".into()))
    }

    /// Where a tensor's data sits in the file: (start, bytes).
    fn data_range(&self, info: &TensorInfo) -> (u64, u64) {
        let block = info.ggml_dtype.block_size().max(1);
        let len = (info.shape.elem_count() / block * info.ggml_dtype.type_size()) as u64;
        (self.content.tensor_data_offset + info.offset, len)
    }

    fn load(&self, name: &str, device: &Device) -> Result<Weight> {
        if !self.has_tensor(name) {
            return Err(ModelError::MissingTensor { name: name.into() });
        }
        let mut file = self.file()?;
        let q = self
            .content
            .tensor(&mut *file, name, device)
            .map_err(|e| ModelError::Corrupt {
                format: "GGUF",
                path: self.path.clone(),
                reason: format!("tensor {name}: {e}"),
            })?;
        self.log.record(name, q.storage_size_in_bytes());
        Ok(Weight::Quantized(Arc::new(q)))
    }

    /// Expert `expert`'s matrix (or bias) of block `block`: its slab of the stacked `ffn_*_exps` tensor
    /// (`[experts, rows, cols]`, each expert's rows back to back), read alone and kept quantized, or the legacy
    /// per-expert tensor (`ffn_gate.{e}.weight`) that older Mixtral conversions wrote.
    fn load_expert(
        &self,
        stacked: &str,
        expert: usize,
        legacy: &str,
        device: &Device,
    ) -> Result<Weight> {
        let Some(info) = self.content.tensor_infos.get(stacked) else {
            return self.load(legacy, device);
        };
        let corrupt = |reason: String| ModelError::Corrupt {
            format: "GGUF",
            path: self.path.clone(),
            reason: format!("tensor {stacked}: {reason}"),
        };
        // Matrices `[experts, rows, cols]`, biases `[experts, rows]`.
        let (experts, each) = match info.shape.dims() {
            &[experts, rows, cols] => (experts, vec![rows, cols]),
            &[experts, rows] if stacked.ends_with(".bias") => (experts, vec![rows]),
            other => {
                return Err(corrupt(format!(
                    "stacked experts must be 3-D (or 2-D biases), not {other:?}"
                )))
            }
        };
        if expert >= experts {
            return Err(ModelError::MissingTensor {
                name: format!("{stacked} expert {expert} (the tensor holds {experts})"),
            });
        }
        let (start, len) = self.data_range(info);
        let slab = len / experts as u64;
        let mut bytes = vec![0u8; slab as usize];
        {
            let mut file = self.file()?;
            file.seek(SeekFrom::Start(start + expert as u64 * slab))
                .and_then(|_| file.read_exact(&mut bytes))
                .map_err(|e| ModelError::io(&self.path, e))?;
        }
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
            info.ggml_dtype,
            &bytes,
            each,
            device,
        )
        .map_err(|e| corrupt(e.to_string()))?;
        self.log.record(stacked, q.storage_size_in_bytes());
        Ok(Weight::Quantized(Arc::new(q)))
    }
}

fn gguf_block_name(block: usize, t: BlockTensor) -> String {
    let leaf = match t {
        BlockTensor::AttnNorm => "attn_norm.weight".to_string(),
        BlockTensor::Q => "attn_q.weight".into(),
        BlockTensor::K => "attn_k.weight".into(),
        BlockTensor::V => "attn_v.weight".into(),
        BlockTensor::O => "attn_output.weight".into(),
        BlockTensor::FfnNorm => "ffn_norm.weight".into(),
        BlockTensor::Gate => "ffn_gate.weight".into(),
        BlockTensor::Up => "ffn_up.weight".into(),
        BlockTensor::Down => "ffn_down.weight".into(),
        BlockTensor::QBias => "attn_q.bias".into(),
        BlockTensor::KBias => "attn_k.bias".into(),
        BlockTensor::VBias => "attn_v.bias".into(),
        BlockTensor::QNorm => "attn_q_norm.weight".into(),
        BlockTensor::KNorm => "attn_k_norm.weight".into(),
        BlockTensor::PostAttnNorm => "post_attention_norm.weight".into(),
        BlockTensor::PostFfnNorm => "post_ffw_norm.weight".into(),
        BlockTensor::Qkv => "attn_qkv.weight".into(),
        // llama.cpp keeps Phi-3's fused gate/up under the up projection's name.
        BlockTensor::GateUp => "ffn_up.weight".into(),
        BlockTensor::Router => "ffn_gate_inp.weight".into(),
        // Experts are read by `load_expert`: this is only their legacy, per-expert name.
        BlockTensor::ExpertGate(e) => format!("ffn_gate.{e}.weight"),
        BlockTensor::ExpertUp(e) => format!("ffn_up.{e}.weight"),
        BlockTensor::ExpertDown(e) => format!("ffn_down.{e}.weight"),
        BlockTensor::SharedGate => "ffn_gate_shexp.weight".into(),
        BlockTensor::SharedUp => "ffn_up_shexp.weight".into(),
        BlockTensor::SharedDown => "ffn_down_shexp.weight".into(),
        BlockTensor::ChoiceBias => "exp_probs_b.bias".into(),
        BlockTensor::RouterBias => "ffn_gate_inp.bias".into(),
        // Read by `load_expert` from the stacked `ffn_*_exps.bias`: only a legacy name.
        BlockTensor::ExpertGateBias(e) => format!("ffn_gate.{e}.bias"),
        BlockTensor::ExpertUpBias(e) => format!("ffn_up.{e}.bias"),
        BlockTensor::ExpertDownBias(e) => format!("ffn_down.{e}.bias"),
        BlockTensor::OBias => "attn_output.bias".into(),
        BlockTensor::Sinks => "attn_sinks.weight".into(),
        BlockTensor::QDown => "attn_q_a.weight".into(),
        BlockTensor::QDownNorm => "attn_q_a_norm.weight".into(),
        BlockTensor::QUp => "attn_q_b.weight".into(),
        BlockTensor::KvDown => "attn_kv_a_mqa.weight".into(),
        BlockTensor::KvDownNorm => "attn_kv_a_norm.weight".into(),
        BlockTensor::KvUp => "attn_kv_b.weight".into(),
        BlockTensor::KeyUp => "attn_k_b.weight".into(),
        BlockTensor::ValueUp => "attn_v_b.weight".into(),
    };
    format!("blk.{block}.{leaf}")
}

impl WeightSource for GgufWeights {
    fn load_block(&self, block: usize, t: BlockTensor, device: &Device) -> Result<Weight> {
        // gpt-oss names the feed-forward's input norm after the attention it follows.
        let gpt_oss = || {
            self.metadata()
                .get("general.architecture")
                .and_then(|v| v.to_string().ok())
                .is_some_and(|a| a == "gpt-oss")
        };
        if t == BlockTensor::FfnNorm && gpt_oss() {
            return self.load(&format!("blk.{block}.post_attention_norm.weight"), device);
        }
        let name = gguf_block_name(block, t);
        let (matrix, expert, leaf) = match t {
            BlockTensor::ExpertGate(e) => ("gate", e, "weight"),
            BlockTensor::ExpertUp(e) => ("up", e, "weight"),
            BlockTensor::ExpertDown(e) => ("down", e, "weight"),
            BlockTensor::ExpertGateBias(e) => ("gate", e, "bias"),
            BlockTensor::ExpertUpBias(e) => ("up", e, "bias"),
            BlockTensor::ExpertDownBias(e) => ("down", e, "bias"),
            _ => return self.load(&name, device),
        };
        let stacked = format!("blk.{block}.ffn_{matrix}_exps.{leaf}");
        self.load_expert(&stacked, expert, &name, device)
    }

    fn load_head(&self, t: HeadTensor, device: &Device) -> Result<Option<Weight>> {
        let name = match t {
            HeadTensor::Embed => "token_embd.weight",
            HeadTensor::FinalNorm => "output_norm.weight",
            HeadTensor::LmHead if !self.has_tensor("output.weight") => return Ok(None),
            HeadTensor::LmHead => "output.weight",
        };
        self.load(name, device).map(Some)
    }

    fn block_of(&self, name: &str) -> Option<usize> {
        name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
    }

    fn log(&self) -> &LoadLog {
        &self.log
    }

    fn quantization(&self) -> String {
        // The dtype most block matmul weights use names the quantization.
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for (name, info) in &self.content.tensor_infos {
            if name.starts_with("blk.") && info.shape.rank() >= 2 {
                *counts
                    .entry(format!("{:?}", info.ggml_dtype).to_lowercase())
                    .or_default() += 1;
            }
        }
        counts
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .map(|(d, _)| d)
            .unwrap_or_else(|| "none".into())
    }

    fn hash_block(&self, block: usize, hasher: &mut Sha256) -> Result<()> {
        let mut infos: Vec<_> = self
            .content
            .tensor_infos
            .iter()
            .filter(|(name, _)| self.block_of(name) == Some(block))
            .collect();
        infos.sort_by(|a, b| a.0.cmp(b.0));
        let mut file = self.file()?;
        for (name, info) in infos {
            hasher.update(name.as_bytes());
            hasher.update(format!("{:?}{:?}", info.ggml_dtype, info.shape.dims()).as_bytes());
            let (start, len) = self.data_range(info);
            super::hash_file_range(&mut file, &self.path, start, len, hasher)?;
        }
        Ok(())
    }

    fn block_stored(&self, block: usize) -> Option<Vec<StoredTensor>> {
        use candle_core::quantized::GgmlDType;
        let tensors = self
            .content
            .tensor_infos
            .iter()
            .filter(|(name, _)| self.block_of(name) == Some(block))
            .map(|(_, info)| StoredTensor {
                elements: info.shape.elem_count() as u64,
                bytes: self.data_range(info).1,
                quantized: !matches!(
                    info.ggml_dtype,
                    GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
                ),
            })
            .collect();
        Some(tensors)
    }

    fn fingerprint(&self, hasher: &mut Sha256) -> Result<()> {
        let mut infos: Vec<_> = self.content.tensor_infos.iter().collect();
        infos.sort_by(|a, b| a.0.cmp(b.0));
        let mut file = self.file()?;
        let file_len = file
            .seek(SeekFrom::End(0))
            .map_err(|e| ModelError::io(&self.path, e))?;
        for (name, info) in infos {
            hasher.update(name.as_bytes());
            hasher.update(
                format!(
                    "{:?}{:?}{}",
                    info.ggml_dtype,
                    info.shape.dims(),
                    info.offset
                )
                .as_bytes(),
            );
            let (start, len) = self.data_range(info);
            for (off, n) in super::sample_ranges(start, len.min(file_len.saturating_sub(start))) {
                let mut buf = vec![0u8; n as usize];
                file.seek(SeekFrom::Start(off))
                    .map_err(|e| ModelError::io(&self.path, e))?;
                file.read_exact(&mut buf)
                    .map_err(|e| ModelError::io(&self.path, e))?;
                hasher.update(&buf);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_core::Tensor;

    /// A file with block 0's gate experts stacked (two experts of 4 x 32, Q8_0) and block 1's "stacked" up
    /// experts wrongly 2-D.
    fn experts_file(dir: &Path) -> PathBuf {
        let dev = Device::Cpu;
        let stacked = Tensor::arange(0f32, 256.0, &dev)
            .and_then(|t| t.reshape((2, 4, 32)))
            .and_then(|t| QTensor::quantize(&t, GgmlDType::Q8_0))
            .unwrap();
        let flat = Tensor::zeros((4, 32), candle_core::DType::F32, &dev)
            .and_then(|t| QTensor::quantize(&t, GgmlDType::Q8_0))
            .unwrap();
        let path = dir.join("experts.gguf");
        let arch = Value::String("llama".into());
        let mut f = File::create(&path).unwrap();
        gguf_file::write(
            &mut f,
            &[("general.architecture", &arch)],
            &[
                ("blk.0.ffn_gate_exps.weight", &stacked),
                ("blk.1.ffn_up_exps.weight", &flat),
            ],
        )
        .unwrap();
        path
    }

    #[test]
    fn each_expert_is_its_own_slab_and_bad_experts_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let w = GgufWeights::open(&experts_file(dir.path())).unwrap();
        let dev = Device::Cpu;
        let second = match w.load_block(0, BlockTensor::ExpertGate(1), &dev).unwrap() {
            Weight::Quantized(q) => q.dequantize(&dev).unwrap(),
            Weight::Dense(_) => panic!("an expert stays quantized"),
        };
        assert_eq!(second.dims(), &[4, 32]);
        // Expert 1 holds the values 128..256; Q8_0 keeps them within a step of their block's scale.
        let first_value: f32 = second
            .flatten_all()
            .unwrap()
            .get(0)
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!((first_value - 128.0).abs() < 1.5, "{first_value}");
        assert!(matches!(
            w.load_block(0, BlockTensor::ExpertGate(2), &dev),
            Err(ModelError::MissingTensor { name }) if name.contains("holds 2")
        ));
        assert!(matches!(
            w.load_block(1, BlockTensor::ExpertUp(0), &dev),
            Err(ModelError::Corrupt { reason, .. }) if reason.contains("3-D")
        ));
        assert!(matches!(
            w.load_block(0, BlockTensor::ExpertDown(0), &dev),
            Err(ModelError::MissingTensor { .. })
        ));
    }
}

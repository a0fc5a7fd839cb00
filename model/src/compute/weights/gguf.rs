//! GGUF files: the header is parsed once; each tensor is read with one seek and one read of exactly its bytes, and
//! stays quantized.
use super::gguf_header::{self, RawTensorInfo};
use super::{BlockTensor, HeadTensor, LoadLog, StoredTensor, Weight, WeightSource};
use crate::compute::linear::Mxfp4Matrix;
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
/// Tensors of types candle does not know (MXFP4) are left out here: [`GgufWeights`] reads them apart.
pub(crate) fn read_header(file: &mut File) -> candle_core::Result<Content> {
    Ok(gguf_header::read_header(&mut std::io::BufReader::new(file))?.0)
}

pub struct GgufWeights {
    path: PathBuf,
    content: Content,
    /// The tensors of types candle does not know (MXFP4), which `content` leaves out.
    raw: BTreeMap<String, RawTensorInfo>,
    file: Mutex<File>,
    log: LoadLog,
    /// gpt-oss names the feed-forward's input norm after the attention it follows (`post_attention_norm`).
    ffn_norm_after_attention: bool,
}

/// One tensor of either index, as hashing and memory planning see it.
struct Entry<'a> {
    name: &'a str,
    /// The type's name and the dimensions, as hashed.
    kind: String,
    dims: Vec<usize>,
    offset: u64,
    start: u64,
    len: u64,
    quantized: bool,
}

impl GgufWeights {
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let (content, raw) = gguf_header::read_header(&mut std::io::BufReader::new(&mut file))
            .map_err(|e| ModelError::Corrupt {
                format: "GGUF",
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        let ffn_norm_after_attention = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .is_some_and(|a| a == "gpt-oss");
        Ok(Self {
            path: path.to_path_buf(),
            content,
            raw,
            file: Mutex::new(file),
            log: LoadLog::default(),
            ffn_norm_after_attention,
        })
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name) || self.raw.contains_key(name)
    }

    pub fn tensor_dims(&self, name: &str) -> Option<Vec<usize>> {
        match self.content.tensor_infos.get(name) {
            Some(i) => Some(i.shape.dims().to_vec()),
            None => self.raw.get(name).map(|r| r.dims.clone()),
        }
    }

    /// Every tensor, candle's and the others, by name.
    fn entries(&self) -> Vec<Entry<'_>> {
        use candle_core::quantized::GgmlDType;
        let mut all: Vec<Entry<'_>> = self
            .content
            .tensor_infos
            .iter()
            .map(|(name, info)| {
                let (start, len) = self.data_range(info);
                Entry {
                    name,
                    kind: format!("{:?}{:?}", info.ggml_dtype, info.shape.dims()),
                    dims: info.shape.dims().to_vec(),
                    offset: info.offset,
                    start,
                    len,
                    quantized: !matches!(
                        info.ggml_dtype,
                        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
                    ),
                }
            })
            .collect();
        all.extend(self.raw.iter().map(|(name, r)| Entry {
            name,
            kind: format!("Mxfp4{:?}", r.dims),
            dims: r.dims.clone(),
            offset: r.offset,
            start: self.raw_start(r),
            len: r.byte_len().unwrap_or(0),
            quantized: true,
        }));
        all.sort_by(|a, b| a.name.cmp(b.name));
        all
    }

    /// Where an MXFP4 tensor's data starts in the file.
    fn raw_start(&self, r: &RawTensorInfo) -> u64 {
        self.content.tensor_data_offset + r.offset
    }

    /// `len` bytes at `start` of the file.
    fn read_at(&self, start: u64, len: u64) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; len as usize];
        let mut file = self.file()?;
        file.seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(|e| ModelError::io(&self.path, e))?;
        Ok(bytes)
    }

    /// This file is corrupt: tensor `name` cannot be what it says, for `reason`.
    fn corrupt(&self, name: &str, reason: impl std::fmt::Display) -> ModelError {
        ModelError::Corrupt {
            format: "GGUF",
            path: self.path.clone(),
            reason: format!("tensor {name}: {reason}"),
        }
    }

    /// An MXFP4 matrix of `rows x cols` from `bytes` of tensor `name`.
    fn mxfp4(&self, name: &str, bytes: &[u8], rows: usize, cols: usize) -> Result<Weight> {
        let m =
            Mxfp4Matrix::from_ggml_bytes(bytes, rows, cols).map_err(|e| self.corrupt(name, e))?;
        self.log.record(name, bytes.len());
        Ok(Weight::Mxfp4(Arc::new(m)))
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
        if let Some(r) = self.raw.get(name) {
            let &[rows, cols] = r.dims.as_slice() else {
                return Err(self.corrupt(
                    name,
                    format!("an MXFP4 tensor of {:?}, not a matrix", r.dims),
                ));
            };
            let bytes = self.read_at(self.raw_start(r), r.byte_len().unwrap_or(0))?;
            return self.mxfp4(name, &bytes, rows, cols);
        }
        if !self.has_tensor(name) {
            return Err(ModelError::MissingTensor { name: name.into() });
        }
        let mut file = self.file()?;
        let q = self
            .content
            .tensor(&mut *file, name, device)
            .map_err(|e| self.corrupt(name, e))?;
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
        // Where the stack is and its type (`None`: MXFP4, which candle's index leaves out).
        let (dims, (start, len), dtype) = match (
            self.raw.get(stacked),
            self.content.tensor_infos.get(stacked),
        ) {
            (Some(r), _) => (
                r.dims.clone(),
                (self.raw_start(r), r.byte_len().unwrap_or(0)),
                None,
            ),
            (None, Some(info)) => (
                info.shape.dims().to_vec(),
                self.data_range(info),
                Some(info.ggml_dtype),
            ),
            (None, None) => return self.load(legacy, device),
        };
        let corrupt = |reason: String| self.corrupt(stacked, reason);
        // Matrices `[experts, rows, cols]`, biases `[experts, rows]`.
        let (experts, each) = match dims.as_slice() {
            &[experts, rows, cols] => (experts, vec![rows, cols]),
            &[experts, rows] if stacked.ends_with(".bias") && dtype.is_some() => {
                (experts, vec![rows])
            }
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
        let slab = len / experts as u64;
        let bytes = self.read_at(start + expert as u64 * slab, slab)?;
        let Some(dtype) = dtype else {
            return self.mxfp4(stacked, &bytes, each[0], each[1]);
        };
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &bytes, each, device)
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
        if t == BlockTensor::FfnNorm && self.ffn_norm_after_attention {
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
        // The dtype that holds most of the blocks' matrix bytes names the quantization (by bytes, not tensors: a
        // gpt-oss file has more small Q8_0 attention matrices than MXFP4 expert stacks).
        let mut bytes: BTreeMap<String, u64> = BTreeMap::new();
        for (name, info) in &self.content.tensor_infos {
            if name.starts_with("blk.") && info.shape.rank() >= 2 {
                *bytes
                    .entry(format!("{:?}", info.ggml_dtype).to_lowercase())
                    .or_default() += self.data_range(info).1;
            }
        }
        let mxfp4: u64 = self
            .raw
            .iter()
            .filter(|(n, _)| n.starts_with("blk."))
            .map(|(_, r)| r.byte_len().unwrap_or(0))
            .sum();
        if mxfp4 > 0 {
            *bytes.entry("mxfp4".into()).or_default() += mxfp4;
        }
        bytes
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .map(|(d, _)| d)
            .unwrap_or_else(|| "none".into())
    }

    fn hash_block(&self, block: usize, hasher: &mut Sha256) -> Result<()> {
        let entries = self.entries();
        let mut file = self.file()?;
        for e in entries
            .iter()
            .filter(|e| self.block_of(e.name) == Some(block))
        {
            hasher.update(e.name.as_bytes());
            hasher.update(e.kind.as_bytes());
            super::hash_file_range(&mut file, &self.path, e.start, e.len, hasher)?;
        }
        Ok(())
    }

    fn block_stored(&self, block: usize) -> Option<Vec<StoredTensor>> {
        let tensors = self
            .entries()
            .into_iter()
            .filter(|e| self.block_of(e.name) == Some(block))
            .map(|e| StoredTensor {
                elements: e.dims.iter().product::<usize>() as u64,
                bytes: e.len,
                quantized: e.quantized,
            })
            .collect();
        Some(tensors)
    }

    fn fingerprint(&self, hasher: &mut Sha256) -> Result<()> {
        let entries = self.entries();
        let mut file = self.file()?;
        let file_len = file
            .seek(SeekFrom::End(0))
            .map_err(|e| ModelError::io(&self.path, e))?;
        for e in entries {
            hasher.update(e.name.as_bytes());
            hasher.update(format!("{}{}", e.kind, e.offset).as_bytes());
            let available = e.len.min(file_len.saturating_sub(e.start));
            for (off, n) in super::sample_ranges(e.start, available) {
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
            Weight::Dense(_) | Weight::Mxfp4(_) => panic!("an expert stays quantized"),
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

    /// gpt-oss's MXFP4 experts (a type candle's parser refuses the whole file for): each expert's slab is read
    /// alone into our MXFP4 matrix, and the block's hash covers its bytes.
    #[test]
    fn mxfp4_experts_are_read_per_expert_and_hashed() {
        use crate::compute::linear::mxfp4::quantize_ggml;
        // A stacked Q4_0 tensor of two experts of [2, 64] (144 bytes), retyped as MXFP4 (136) in place.
        let x = Tensor::zeros((2, 2, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&x, GgmlDType::Q4_0).unwrap();
        let name = "blk.0.ffn_gate_exps.weight";
        let mut file = std::io::Cursor::new(vec![]);
        gguf_file::write(&mut file, &[], &[(name, &q)]).unwrap();
        let mut bytes = file.into_inner();
        let mut key = (name.len() as u64).to_le_bytes().to_vec();
        key.extend(name.as_bytes());
        let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 8 * 3;
        bytes[at..at + 4].copy_from_slice(&39u32.to_le_bytes());
        let values: Vec<f32> = (0..256)
            .map(|i| [0.0, 1.0, -2.0, 3.0, -6.0][i % 5])
            .collect();
        let (content, raw) = gguf_header::read_header(&mut std::io::Cursor::new(&bytes)).unwrap();
        let start = (content.tensor_data_offset + raw[name].offset) as usize;
        bytes[start..start + 136].copy_from_slice(&quantize_ggml(&values, 64));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mxfp4.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let w = GgufWeights::open(&path).unwrap();
        assert_eq!(w.quantization(), "mxfp4");
        let second = match w
            .load_block(0, BlockTensor::ExpertGate(1), &Device::Cpu)
            .unwrap()
        {
            Weight::Mxfp4(m) => m,
            _ => panic!("an MXFP4 expert stays MXFP4"),
        };
        assert_eq!((second.rows(), second.cols()), (2, 64));
        assert_eq!(second.dequantize(), values[128..]);
        assert!(matches!(
            w.load_block(0, BlockTensor::ExpertGate(2), &Device::Cpu),
            Err(ModelError::MissingTensor { .. })
        ));
        let hash = |path: &Path| {
            let mut h = Sha256::new();
            GgufWeights::open(path)
                .unwrap()
                .hash_block(0, &mut h)
                .unwrap();
            h.finalize()
        };
        let before = hash(&path);
        bytes[start + 140 - 4] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(hash(&path), before, "bytes past the tensor are not hashed");
        bytes[start + 100] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_ne!(hash(&path), before, "the expert's bytes are");
    }
}

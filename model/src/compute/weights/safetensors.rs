//! Hugging Face safetensors, one file or sharded (`model.safetensors.index.json`), memory-mapped: a tensor's pages
//! are touched only when it is loaded.
use super::shards::{ShardFetch, Shards};
use super::{BlockTensor, HeadTensor, HfLayout, LoadLog, StoredTensor, Weight, WeightSource};
use crate::compute::linear::{mxfp4, Mxfp4Matrix};
use crate::error::{ModelError, Result};
use candle_core::Device;
use safetensors::Dtype;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The suffixes of an MXFP4 matrix's two tensors in a checkpoint (gpt-oss as OpenAI ships it).
const MXFP4_BLOCKS: &str = "_blocks";
const MXFP4_SCALES: &str = "_scales";

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

impl SafetensorsWeights {
    /// gpt-oss's expert tensors: expert `e`'s part of a block's stacked `mlp.experts.*` tensor, read alone (its
    /// bytes are contiguous: the experts are the outer dimension) and laid out as the other families' are: gate and
    /// up de-interleaved from `gate_up_proj` (`[hidden, 2 x size]`, gate at even columns), matrices transposed to
    /// `[out, in]`. `None` for any other tensor.
    fn load_stacked_expert(
        &self,
        block: usize,
        t: BlockTensor,
        device: &Device,
    ) -> Result<Option<Weight>> {
        use BlockTensor as T;
        let (leaf, expert, half) = match t {
            T::ExpertGate(e) => ("gate_up_proj", e, Some(0)),
            T::ExpertUp(e) => ("gate_up_proj", e, Some(1)),
            T::ExpertDown(e) => ("down_proj", e, None),
            T::ExpertGateBias(e) => ("gate_up_proj_bias", e, Some(0)),
            T::ExpertUpBias(e) => ("gate_up_proj_bias", e, Some(1)),
            T::ExpertDownBias(e) => ("down_proj_bias", e, None),
            _ => return Ok(None),
        };
        let name = format!("model.layers.{block}.mlp.experts.{leaf}");
        if !self.has(&name) && self.has(&format!("{name}{MXFP4_BLOCKS}")) {
            return self.load_mxfp4_expert(&name, expert, half).map(Some);
        }
        let view = self.st.get(&name)?;
        let dims = view.shape().to_vec();
        let bad = |reason: String| ModelError::TensorShape {
            name: format!("{name} ({reason})"),
            expected: vec![],
            actual: dims.clone(),
        };
        let (&experts, each) = dims
            .split_first()
            .filter(|(_, each)| matches!(each.len(), 1 | 2))
            .ok_or_else(|| bad("expected [experts, ..] of 2 or 3 dimensions".into()))?;
        if expert >= experts {
            return Err(ModelError::MissingTensor {
                name: format!("{name} expert {expert} (the tensor holds {experts})"),
            });
        }
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => candle_core::DType::F32,
            safetensors::Dtype::F16 => candle_core::DType::F16,
            safetensors::Dtype::BF16 => candle_core::DType::BF16,
            other => return Err(bad(format!("dtype {other:?} is not a float"))),
        };
        let data = view.data();
        let slab = data.len() / experts;
        let bytes = &data[expert * slab..(expert + 1) * slab];
        let x = candle_core::Tensor::from_raw_buffer(bytes, dtype, each, device)?;
        // The matrices are stored `[in, out]`: the last dimension is the output.
        let x = match half {
            Some(h) => {
                let out = *each.last().unwrap_or(&0);
                if out % 2 != 0 {
                    return Err(bad("gate and up interleaved need an even width".into()));
                }
                let mut split = each.to_vec();
                split.pop();
                split.extend([out / 2, 2]);
                x.reshape(split)?
                    .narrow(each.len(), h, 1)?
                    .squeeze(each.len())?
            }
            None => x,
        };
        let x = if x.rank() == 2 {
            x.t()?.contiguous()?
        } else {
            x
        };
        self.log.record(&name, bytes.len());
        Ok(Some(Weight::Dense(x)))
    }

    /// Expert `expert`'s matrix of an MXFP4 checkpoint: `{name}_blocks` (`[experts, rows, cols / 32, 16]` bytes) and
    /// `{name}_scales` (`[experts, rows, cols / 32]` exponents), output-major, so gate and up interleave by row (gate
    /// at even rows, as they do by column once dequantized). Only that expert's bytes (of `half`'s rows) are read,
    /// and repacked for our kernels ([`Mxfp4Matrix::from_hf_blocks`]), not dequantized.
    fn load_mxfp4_expert(&self, name: &str, expert: usize, half: Option<usize>) -> Result<Weight> {
        let (blocks_name, scales_name) = (
            format!("{name}{MXFP4_BLOCKS}"),
            format!("{name}{MXFP4_SCALES}"),
        );
        let (blocks, scales) = (self.st.get(&blocks_name)?, self.st.get(&scales_name)?);
        let bad = |name: &str, reason: &str, actual: &[usize]| ModelError::TensorShape {
            name: format!("{name} ({reason})"),
            expected: vec![],
            actual: actual.to_vec(),
        };
        let &[experts, rows, groups, 16] = blocks.shape() else {
            return Err(bad(
                &blocks_name,
                "expected [experts, rows, blocks, 16] bytes",
                blocks.shape(),
            ));
        };
        if scales.shape() != [experts, rows, groups] {
            return Err(ModelError::TensorShape {
                name: scales_name,
                expected: vec![experts, rows, groups],
                actual: scales.shape().to_vec(),
            });
        }
        if blocks.dtype() != Dtype::U8 || scales.dtype() != Dtype::U8 {
            return Err(bad(&blocks_name, "MXFP4 blocks and scales are U8", &[]));
        }
        let m = Mxfp4Matrix::from_hf_stack(
            blocks.data(),
            scales.data(),
            (experts, rows, groups * 32),
            expert,
            half,
        )
        .map_err(|e| match e {
            ModelError::Config(reason) if expert >= experts => ModelError::MissingTensor {
                name: format!("{blocks_name} expert {expert}: {reason}"),
            },
            ModelError::Config(reason) => bad(&blocks_name, &reason, blocks.shape()),
            other => other,
        })?;
        self.log
            .record(&blocks_name, m.rows() * groups * mxfp4::BLOCK_BYTES);
        Ok(Weight::Mxfp4(Arc::new(m)))
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
        BlockTensor::Router if layout == HfLayout::GptOss => "mlp.router.weight".into(),
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
        BlockTensor::ChoiceBias => "mlp.gate.e_score_correction_bias".into(),
        BlockTensor::RouterBias => "mlp.router.bias".into(),
        // gpt-oss's experts are slices of stacked tensors (`load_stacked_expert`); these are only names for errors.
        BlockTensor::ExpertGateBias(e) => format!("mlp.experts.{e}.gate_proj.bias"),
        BlockTensor::ExpertUpBias(e) => format!("mlp.experts.{e}.up_proj.bias"),
        BlockTensor::ExpertDownBias(e) => format!("mlp.experts.{e}.down_proj.bias"),
        BlockTensor::OBias => "self_attn.o_proj.bias".into(),
        BlockTensor::Sinks => "self_attn.sinks".into(),
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
        if self.layout == HfLayout::GptOss {
            if let Some(w) = self.load_stacked_expert(block, t, device)? {
                return Ok(w);
            }
        }
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
        if self.st.names().any(|n| n.ends_with(MXFP4_BLOCKS)) {
            "mxfp4".into()
        } else {
            "none".into()
        }
    }

    /// From the headers of shards already on disk (a hub model's are not fetched for this). MXFP4 blocks and
    /// scales count as quantized bytes, the values they hold as the elements they dequantize to.
    fn block_stored(&self, block: usize) -> Option<Vec<StoredTensor>> {
        let tensors = self
            .st
            .local_tensors_where(|name| self.block_of(name) == Some(block))?;
        let stored = tensors
            .iter()
            .map(|(name, view)| {
                let bytes = view.data().len() as u64;
                let mxfp4 = view.dtype() == Dtype::U8;
                // Two values a byte in the blocks; the scales are not values.
                let elements = if !mxfp4 {
                    view.shape().iter().product::<usize>() as u64
                } else if name.ends_with(MXFP4_BLOCKS) {
                    2 * bytes
                } else {
                    0
                };
                StoredTensor {
                    elements,
                    bytes,
                    quantized: mxfp4,
                }
            })
            .collect();
        Some(stored)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::linear::mxfp4::quantize_ggml;
    use crate::synthetic::{gpt_oss_mxfp4_checkpoint, write_model, SyntheticShape, WeightDType};

    /// An MXFP4 checkpoint's experts (quantized from the whole interleaved `[experts, in, out]` stack, as OpenAI's
    /// are) load per expert as the rows of gate, up and down that the dense checkpoint's expert quantizes to.
    #[test]
    fn mxfp4_experts_load_per_expert_as_the_dense_ones_quantize() {
        let dir = tempfile::tempdir().unwrap();
        let shape = SyntheticShape::named("gpt-oss-tiny").unwrap();
        let (dense_dir, mxfp4_dir) = (dir.path().join("f32"), dir.path().join("mxfp4"));
        write_model(&dense_dir, &shape, WeightDType::F32, 5).unwrap();
        gpt_oss_mxfp4_checkpoint(&dense_dir, &mxfp4_dir).unwrap();
        let open = |d: &Path| {
            SafetensorsWeights::open(d)
                .unwrap()
                .with_layout(HfLayout::GptOss)
        };
        let (dense, mxfp4) = (open(&dense_dir), open(&mxfp4_dir));
        assert_eq!(
            (dense.quantization(), mxfp4.quantization()),
            ("none".into(), "mxfp4".into())
        );
        for t in [
            BlockTensor::ExpertGate(3),
            BlockTensor::ExpertUp(3),
            BlockTensor::ExpertDown(0),
        ] {
            let Weight::Dense(d) = dense.load_block(2, t, &Device::Cpu).unwrap() else {
                panic!("{t:?} of the dense checkpoint is dense");
            };
            let (rows, cols) = d.dims2().unwrap();
            let values: Vec<f32> = d.flatten_all().unwrap().to_vec1().unwrap();
            let want = Mxfp4Matrix::from_ggml_bytes(&quantize_ggml(&values, cols), rows, cols)
                .unwrap()
                .dequantize();
            let Weight::Mxfp4(m) = mxfp4.load_block(2, t, &Device::Cpu).unwrap() else {
                panic!("{t:?} of the MXFP4 checkpoint stays MXFP4");
            };
            assert_eq!((m.rows(), m.cols()), (rows, cols), "{t:?}");
            assert_eq!(m.dequantize(), want, "{t:?}");
        }
        // Biases are dense in both.
        assert!(matches!(
            mxfp4.load_block(2, BlockTensor::ExpertUpBias(3), &Device::Cpu),
            Ok(Weight::Dense(_))
        ));
        assert!(matches!(
            mxfp4.load_block(2, BlockTensor::ExpertGate(99), &Device::Cpu),
            Err(ModelError::MissingTensor { .. })
        ));
        // The memory plan counts the packed bytes (17 a block of 32 values), not the values in f32.
        let loaded = |w: &SafetensorsWeights| -> (u64, u64) {
            let stored = w.block_stored(1).unwrap();
            let packed = stored.iter().filter(|t| t.quantized).map(|t| t.bytes).sum();
            let all = stored
                .iter()
                .map(|t| t.loaded_bytes(candle_core::DType::F32))
                .sum();
            (packed, all)
        };
        let e = shape.expert_shape().unwrap();
        let expert_values = (e.count * 3 * e.size * shape.hidden_size) as u64;
        let ((none, dense_bytes), (packed, mxfp4_bytes)) = (loaded(&dense), loaded(&mxfp4));
        assert_eq!((none, packed), (0, expert_values / 32 * 17));
        assert_eq!(mxfp4_bytes, dense_bytes - 4 * expert_values + packed);
    }
}

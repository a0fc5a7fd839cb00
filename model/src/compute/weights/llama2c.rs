//! llama2.c checkpoints (`stories260K.bin`): a 7 x i32 header, then every weight kind for all layers in turn (all
//! attention norms, then all wq, ...). A block's tensors are scattered through the file, so each is read at its
//! computed offset and nothing else is touched.
use super::{BlockTensor, HeadTensor, LoadLog, Weight, WeightSource};
use crate::compute::spec::{ModelSpec, RopeStyle};
use crate::error::{ModelError, Result};
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The llama2.c header.
#[derive(Debug, Clone, Copy)]
pub struct Llama2cHeader {
    pub dim: usize,
    pub hidden_dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    /// A negative vocab size in the file means the classifier is stored separately.
    pub shared_classifier: bool,
    pub seq_len: usize,
}

/// Where one weight kind starts, and how many f32s each layer's slice holds.
#[derive(Debug, Clone, Copy)]
struct Region {
    offset: u64,
    per_layer: usize,
}

impl Region {
    /// Where layer `layer`'s slice sits in the file: (start, bytes).
    fn layer(&self, layer: usize) -> (u64, u64) {
        let bytes = self.per_layer * 4;
        (self.offset + (layer * bytes) as u64, bytes as u64)
    }
}

pub struct Llama2cWeights {
    path: PathBuf,
    header: Llama2cHeader,
    file: Mutex<File>,
    log: LoadLog,
    embed: Region,
    blocks: [(BlockTensor, Region, [usize; 2]); 9],
    final_norm: Region,
    classifier: Option<Region>,
    file_len: u64,
}

const HEADER_BYTES: u64 = 28;

impl Llama2cWeights {
    pub fn open(path: &Path) -> Result<Self> {
        let corrupt = |reason: String| ModelError::Corrupt {
            format: "llama2.c",
            path: path.to_path_buf(),
            reason,
        };
        let mut file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let file_len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        let mut raw = [0u8; HEADER_BYTES as usize];
        file.read_exact(&mut raw).map_err(|_| {
            corrupt(format!(
                "{file_len} bytes is shorter than the 28-byte header"
            ))
        })?;
        let h: Vec<i32> = raw
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // Reject absurd headers before computing offsets with them.
        const LIMIT: i32 = 1 << 20;
        let names = [
            "dim",
            "hidden_dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "vocab_size",
            "seq_len",
        ];
        for (i, v) in h.iter().enumerate() {
            if *v == 0 || v.unsigned_abs() > LIMIT as u32 || (*v < 0 && i != 5) {
                return Err(corrupt(format!(
                    "header field {} = {v} is out of range",
                    names[i]
                )));
            }
        }
        let header = Llama2cHeader {
            dim: h[0] as usize,
            hidden_dim: h[1] as usize,
            n_layers: h[2] as usize,
            n_heads: h[3] as usize,
            n_kv_heads: h[4] as usize,
            vocab_size: h[5].unsigned_abs() as usize,
            shared_classifier: h[5] > 0,
            seq_len: h[6] as usize,
        };
        if !header.dim.is_multiple_of(header.n_heads)
            || !header.n_heads.is_multiple_of(header.n_kv_heads)
        {
            return Err(corrupt(format!("inconsistent heads in header {header:?}")));
        }
        let (d, hd, l) = (header.dim, header.hidden_dim, header.n_layers);
        let kv = header.dim / header.n_heads * header.n_kv_heads;
        let head_size = d / header.n_heads;
        // Element counts in file order.
        let mut offset = HEADER_BYTES;
        let mut next = |per_layer: usize, layers: usize| {
            let r = Region { offset, per_layer };
            offset += (per_layer * layers * 4) as u64;
            r
        };
        let embed = next(header.vocab_size * d, 1);
        let att_norm = next(d, l);
        let wq = next(d * d, l);
        let wk = next(kv * d, l);
        let wv = next(kv * d, l);
        let wo = next(d * d, l);
        let ffn_norm = next(d, l);
        let w1 = next(hd * d, l);
        let w2 = next(d * hd, l);
        let w3 = next(hd * d, l);
        let final_norm = next(d, 1);
        let _freq_cis = next(header.seq_len * head_size, 1);
        let classifier = (!header.shared_classifier).then(|| next(header.vocab_size * d, 1));
        if offset != file_len {
            return Err(corrupt(format!(
                "the header promises {offset} bytes of weights, the file has {file_len}"
            )));
        }
        let blocks = [
            (BlockTensor::AttnNorm, att_norm, [d, 0]),
            (BlockTensor::Q, wq, [d, d]),
            (BlockTensor::K, wk, [kv, d]),
            (BlockTensor::V, wv, [kv, d]),
            (BlockTensor::O, wo, [d, d]),
            (BlockTensor::FfnNorm, ffn_norm, [d, 0]),
            (BlockTensor::Gate, w1, [hd, d]),
            (BlockTensor::Down, w2, [d, hd]),
            (BlockTensor::Up, w3, [hd, d]),
        ];
        Ok(Self {
            path: path.to_path_buf(),
            header,
            file: Mutex::new(file),
            log: LoadLog::default(),
            embed,
            blocks,
            final_norm,
            classifier,
            file_len,
        })
    }

    pub fn header(&self) -> Llama2cHeader {
        self.header
    }

    /// The model description: llama2.c models are Llama with interleaved RoPE, theta 10000, eps 1e-5, BOS 1, EOS 2.
    pub fn spec(&self, name: &str) -> Result<ModelSpec> {
        let h = self.header;
        let spec = ModelSpec {
            name: name.to_string(),
            architecture: "llama".into(),
            num_blocks: h.n_layers,
            hidden_size: h.dim,
            intermediate_size: h.hidden_dim,
            num_heads: h.n_heads,
            num_kv_heads: h.n_kv_heads,
            head_dim: h.dim / h.n_heads,
            vocab_size: h.vocab_size,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Interleaved,
            rms_eps: 1e-5,
            max_position: h.seq_len,
            tie_embeddings: h.shared_classifier,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            options: Default::default(),
        };
        spec.validate()?;
        Ok(spec)
    }

    fn file(&self) -> Result<std::sync::MutexGuard<'_, File>> {
        self.file
            .lock()
            .map_err(|_| ModelError::Config("llama2.c reader poisoned by an earlier panic".into()))
    }

    fn read(&self, name: &str, offset: u64, dims: &[usize], device: &Device) -> Result<Weight> {
        let n: usize = dims.iter().product();
        let mut bytes = vec![0u8; n * 4];
        {
            let mut file = self.file()?;
            file.seek(SeekFrom::Start(offset))
                .map_err(|e| ModelError::io(&self.path, e))?;
            file.read_exact(&mut bytes)
                .map_err(|e| ModelError::io(&self.path, e))?;
        }
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        self.log.record(name, bytes.len());
        Ok(Weight::Dense(Tensor::from_vec(values, dims, device)?))
    }
}

fn block_tensor_name(block: usize, t: BlockTensor) -> String {
    format!("layers.{block}.{t:?}")
}

impl WeightSource for Llama2cWeights {
    fn load_block(&self, block: usize, t: BlockTensor, device: &Device) -> Result<Weight> {
        let name = block_tensor_name(block, t);
        if block >= self.header.n_layers {
            return Err(ModelError::MissingTensor { name });
        }
        let (_, region, dims) = self
            .blocks
            .iter()
            .find(|(kind, _, _)| *kind == t)
            .copied()
            .ok_or_else(|| ModelError::MissingTensor { name: name.clone() })?;
        let dims: Vec<usize> = dims.into_iter().filter(|d| *d > 0).collect();
        self.read(&name, region.layer(block).0, &dims, device)
    }

    fn load_head(&self, t: HeadTensor, device: &Device) -> Result<Option<Weight>> {
        let (v, d) = (self.header.vocab_size, self.header.dim);
        match t {
            HeadTensor::Embed => self
                .read("token_embedding_table", self.embed.offset, &[v, d], device)
                .map(Some),
            HeadTensor::FinalNorm => self
                .read("rms_final_weight", self.final_norm.offset, &[d], device)
                .map(Some),
            HeadTensor::LmHead => match self.classifier {
                None => Ok(None),
                Some(r) => self.read("wcls", r.offset, &[v, d], device).map(Some),
            },
        }
    }

    fn block_of(&self, name: &str) -> Option<usize> {
        name.strip_prefix("layers.")?
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
        let mut file = self.file()?;
        let mut regions: Vec<_> = self
            .blocks
            .iter()
            .map(|(t, r, dims)| (block_tensor_name(block, *t), *r, *dims))
            .collect();
        regions.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, region, dims) in regions {
            hasher.update(format!("{name}F32{dims:?}").as_bytes());
            let (start, len) = region.layer(block);
            super::hash_file_range(&mut file, &self.path, start, len, hasher)?;
        }
        Ok(())
    }

    fn fingerprint(&self, hasher: &mut Sha256) -> Result<()> {
        hasher.update(format!("{:?}{}", self.header, self.file_len).as_bytes());
        let mut file = self.file()?;
        let l = self.header.n_layers;
        let mut regions = vec![(self.embed, 1), (self.final_norm, 1)];
        regions.extend(self.blocks.iter().map(|(_, r, _)| (*r, l)));
        regions.extend(self.classifier.map(|r| (r, 1)));
        for (region, layers) in regions {
            for layer in 0..layers {
                let (start, len) = region.layer(layer);
                for (off, n) in super::sample_ranges(start, len) {
                    let mut buf = vec![0u8; n as usize];
                    file.seek(SeekFrom::Start(off))
                        .map_err(|e| ModelError::io(&self.path, e))?;
                    file.read_exact(&mut buf)
                        .map_err(|e| ModelError::io(&self.path, e))?;
                    hasher.update(&buf);
                }
            }
        }
        Ok(())
    }
}

//! Loading spans: the devices and the model a node opens once at start, and any span of that model onto them
//! (the first, and each one the balancer moves to). Runs on the blocking pool: it reads weights from disk.
use crate::{devices, NodeError, Result};
use candle_core::{DType, Device};
use petal_model::compute::placement::device_memory;
use petal_model::{BlockRange, BlockSpan, ModelFormat, ModelSource};
use petal_proto::pb;
use std::sync::Arc;

/// Share of the free memory the blocks and their KV cache may take when `--num-blocks` is not given: the rest is
/// for activations, the runtime and whatever else the machine runs.
const MEMORY_SHARE: f64 = 0.8;

/// A span loaded onto the node's devices, with what its announcement says about it.
pub struct LoadedSpan {
    pub span: Arc<BlockSpan>,
    /// The served blocks' hashes (read from those blocks only).
    pub block_hashes: Vec<String>,
    /// The devices as announced: consecutive blocks grouped by the device they were placed on.
    pub devices: Vec<pb::DeviceInfo>,
}

/// The opened model and devices of a node, and how it places blocks on them.
pub struct SpanLoader {
    source: ModelSource,
    devices: Vec<Device>,
    split: Option<Vec<usize>>,
    dtype: DType,
    kv_dtype: Option<DType>,
    /// The node's KV budget in positions: the size of each block's cache arena on a GPU.
    cache_tokens: usize,
    progress: Option<indicatif::MultiProgress>,
}

impl SpanLoader {
    /// Opens the devices and the model (headers only). An absent device or a missing model fails here.
    pub fn open(config: &crate::NodeConfig) -> Result<Self> {
        let devices = devices::open_devices(&config.devices)?;
        let source = petal_model::hub::open(&config.model, &config.hub)?;
        let dtype = source.block_dtype(config.dtype);
        Ok(Self {
            source,
            devices,
            split: config.split.clone(),
            dtype,
            kv_dtype: config.kv_dtype,
            cache_tokens: config.cache_tokens,
            progress: config.progress.clone(),
        })
    }

    pub fn source(&self) -> &ModelSource {
        &self.source
    }

    /// The dtype the blocks compute in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype sessions' keys and values are stored in.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype.unwrap_or(self.dtype)
    }

    /// Checks `range` against the model and loads it, with a progress bar.
    pub fn load(&self, range: BlockRange) -> Result<LoadedSpan> {
        range.validate(self.source.spec().num_blocks)?;
        let counts = devices::plan_split(range.len(), &self.devices, self.split.as_deref())?;
        let placements = devices::placements(&self.devices, &counts, self.dtype);
        let bar = indicatif::ProgressBar::new(range.len() as u64)
            .with_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:30}] {pos}/{len} blocks ({elapsed})",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            )
            .with_message(format!("loading blocks {range}"));
        let bar = match &self.progress {
            Some(group) => group.add(bar),
            None => bar,
        };
        let span = self
            .source
            .load_span_with_progress(range, &placements, |_| bar.inc(1));
        bar.finish_and_clear();
        let mut span = span?;
        span.set_kv_dtype(self.kv_dtype);
        span.set_kv_budget(Some(self.cache_tokens));
        let span = Arc::new(span);
        let block_hashes = self.source.block_hashes(range)?;
        let devices = span_devices(&span);
        Ok(LoadedSpan {
            span,
            block_hashes,
            devices,
        })
    }

    /// How many blocks this node can hold: as many as fit [`MEMORY_SHARE`] of its devices' free memory with a
    /// KV cache of `cache_tokens` positions each, at most the whole model, at least one (or an error saying why
    /// not even one fits). Devices whose free memory is unknown count as holding every block.
    pub fn blocks_that_fit(&self, cache_tokens: usize) -> Result<usize> {
        let spec = self.source.spec();
        let weights = self.block_weight_bytes();
        let cache = (cache_tokens
            * spec.kv_bytes_per_token_per_block(self.kv_dtype().size_in_bytes()))
            as f64;
        let per_block = weights + cache;
        let mut free = 0.0;
        for d in &self.devices {
            match available_memory(d) {
                Some(bytes) => free += bytes as f64,
                None => return Ok(spec.num_blocks),
            }
        }
        let fit = (free * MEMORY_SHARE / per_block.max(1.0)).floor() as usize;
        if fit == 0 {
            return Err(NodeError::Devices(format!(
                "not even one block fits: a block takes about {} MiB with its KV cache of {cache_tokens} positions, \
                 {} MiB are free; lower --cache-tokens or free memory",
                (per_block / 1048576.0).ceil(),
                (free / 1048576.0).floor()
            )));
        }
        Ok(fit.min(spec.num_blocks))
    }

    /// Bytes one block's weights take once loaded: the file's own bytes per parameter where they stay as stored
    /// (quantized GGUF), else the compute dtype's.
    fn block_weight_bytes(&self) -> f64 {
        let spec = self.source.spec();
        let h = spec.hidden_size as f64;
        let block_params = spec.block_parameters() as f64;
        let head_params = spec.vocab_size as f64 * h * if spec.tie_embeddings { 1.0 } else { 2.0 };
        let stays_quantized = self.source.format() == ModelFormat::Gguf && self.dtype == DType::F32;
        let bytes_per_param = match self.file_bytes() {
            Some(file) if stays_quantized => {
                file / (block_params * spec.num_blocks as f64 + head_params).max(1.0)
            }
            _ => self.dtype.size_in_bytes() as f64,
        };
        block_params * bytes_per_param
    }

    fn file_bytes(&self) -> Option<f64> {
        let files = self.source.weight_files().ok()?;
        let sizes: std::io::Result<Vec<u64>> = files
            .iter()
            .map(|f| std::fs::metadata(f).map(|m| m.len()))
            .collect();
        sizes.ok().map(|s| s.iter().sum::<u64>() as f64)
    }
}

/// Free memory on a device: the GPU's own figure, or the system's available memory for the CPU.
fn available_memory(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => system_available_memory(),
        d => device_memory(d).map(|(free, _)| free),
    }
}

/// `MemAvailable` from /proc/meminfo (Linux); `None` elsewhere.
fn system_available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The devices of the span as announced: consecutive blocks grouped by the device they were placed on.
fn span_devices(span: &BlockSpan) -> Vec<pb::DeviceInfo> {
    let mut devices: Vec<Device> = vec![];
    let mut counts: Vec<usize> = vec![];
    for b in span.blocks() {
        let d = &b.placement().device;
        match (devices.last(), counts.last_mut()) {
            (Some(last), Some(count)) if last.same_device(d) => *count += 1,
            _ => {
                devices.push(d.clone());
                counts.push(1);
            }
        }
    }
    devices::device_infos(&devices, &counts, span.range())
}

/// Decode tokens per second through the whole span, from a few single-token steps of a throwaway session.
pub fn measure_throughput(span: &BlockSpan) -> Result<f64> {
    const STEPS: usize = 8;
    let mut session = span.new_cache(span.range(), STEPS + 1)?;
    let p = span.input_placement();
    let x = candle_core::Tensor::zeros((1, 1, span.spec().hidden_size), p.dtype, &p.device)?;
    span.forward(&x, 0, &mut session)?; // warm-up
    let started = std::time::Instant::now();
    for pos in 1..=STEPS {
        span.forward(&x, pos, &mut session)?;
    }
    Ok(STEPS as f64 / started.elapsed().as_secs_f64().max(1e-9))
}

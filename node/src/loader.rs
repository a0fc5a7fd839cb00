//! Loading spans: the devices and the model a node opens once at start, and any span of that model onto them
//! (the first, and each one the balancer moves to). Runs on the blocking pool: it reads weights from disk.
use crate::memory::MemoryNeeds;
use crate::{devices, Result};
use candle_core::{DType, Device};
use petal_model::compute::placement::device_memory;
use petal_model::{BlockRange, BlockSpan, ModelSource};
use petal_proto::pb;
use std::sync::Arc;

/// A span loaded onto the node's devices, with what its announcement says about it.
pub struct LoadedSpan {
    pub span: Arc<BlockSpan>,
    /// The served blocks' hashes (read from those blocks only).
    pub block_hashes: Vec<String>,
    /// The devices as announced: consecutive blocks grouped by the device they were placed on.
    pub devices: Vec<pb::DeviceInfo>,
    /// Bytes the span's weights take (as the memory plan counts them).
    pub weight_bytes: u64,
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
        let weight_bytes = (range.start..range.end)
            .map(|b| self.source.block_weight_bytes(b, self.dtype))
            .sum();
        Ok(LoadedSpan {
            span,
            block_hashes,
            devices,
            weight_bytes,
        })
    }

    /// What the model's blocks need in memory, from the file's header alone.
    pub fn memory_needs(
        &self,
        max_chunk_tokens: usize,
        cache_tokens: usize,
        limits: &crate::limits::ServeLimits,
    ) -> MemoryNeeds {
        let spec = self.source.spec();
        let weights = (0..spec.num_blocks)
            .map(|b| self.source.block_weight_bytes(b, self.dtype))
            .collect();
        MemoryNeeds::new(
            spec,
            weights,
            self.kv_dtype().size_in_bytes(),
            max_chunk_tokens,
            cache_tokens,
            limits,
        )
    }

    /// Free memory across the node's devices; `None` when one of them does not say.
    pub fn free_memory(&self) -> Option<u64> {
        self.devices.iter().map(available_memory).sum()
    }

    /// The KV budget in positions the spans loaded from now on get (the memory plan's).
    pub fn set_cache_tokens(&mut self, positions: usize) {
        self.cache_tokens = positions;
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

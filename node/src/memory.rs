//! The node's memory budget (`--max-memory`, or what the devices report free less a margin): the weights of its
//! span, the KV reservations of its sessions and the workspace of a step, in bytes of the model's real shape,
//! planned from the file's header before anything is read.
//!
//! Without `--blocks` a node takes as many blocks as fit with a full KV cache each (Petals' rule); a given span
//! gets whatever the budget leaves after its weights and workspace, capped at `--cache-tokens`. An automatic span
//! is planned for its heaviest window of that many blocks, so wherever the balancer moves it, it still fits.
use crate::limits::ServeLimits;
use bytesize::ByteSize;
use petal_model::compute::block::step_working_bytes;
use petal_model::{BlockRange, ModelSpec};

/// What the node holds besides its span and sessions, kept free of the budget when the default is used: the
/// runtime, the client-side loads of a shared machine, the page cache the file is read through.
const DEFAULT_MARGIN_SHARE: u64 = 10;
const MIN_MARGIN: u64 = 512 << 20;

/// Bytes the node may use, and where that figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    /// `--max-memory`, rather than the free memory the devices reported.
    pub asked: bool,
}

impl Budget {
    /// `--max-memory`, or the devices' free memory less a margin (a tenth, at least 512 MiB); `None` when no
    /// budget was asked and a device does not say what it has free.
    pub fn new(asked: Option<u64>, free: Option<u64>) -> Option<Self> {
        match (asked, free) {
            (Some(bytes), _) => Some(Self { bytes, asked: true }),
            (None, Some(free)) => Some(Self {
                bytes: free.saturating_sub((free / DEFAULT_MARGIN_SHARE).max(MIN_MARGIN)),
                asked: false,
            }),
            (None, None) => None,
        }
    }

    fn describe(&self) -> String {
        if self.asked {
            format!("--max-memory {}", size(self.bytes))
        } else {
            format!(
                "the {} this machine has free (less a margin; --max-memory sets the budget)",
                size(self.bytes)
            )
        }
    }
}

/// A span's memory as planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    pub num_blocks: usize,
    /// Positions (batch x tokens) of KV cache the node admits across its sessions.
    pub cache_tokens: usize,
    /// The span's weights (for an automatic span, its heaviest window of `num_blocks`).
    pub weight_bytes: u64,
    /// KV bytes of one position through the whole span.
    pub position_bytes: u64,
    pub workspace_bytes: u64,
    /// `None`: no budget known, nothing checked.
    pub budget: Option<Budget>,
}

impl MemoryPlan {
    pub fn kv_bytes(&self) -> u64 {
        self.cache_tokens as u64 * self.position_bytes
    }
}

/// A budget that cannot hold what was asked: every figure is in the message.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum MemoryError {
    #[error(
        "blocks {range} do not fit {budget}: their weights take {weights}, a step's workspace {workspace} and \
         the smallest KV cache that serves a prompt ({positions} positions) {kv}; nothing was loaded"
    )]
    SpanTooBig {
        range: BlockRange,
        budget: String,
        weights: String,
        workspace: String,
        positions: usize,
        kv: String,
    },
    #[error(
        "not even one block fits {budget}: one takes {weights} with a step's workspace of {workspace} and the \
         smallest KV cache that serves a prompt ({positions} positions, {kv})"
    )]
    NoBlockFits {
        budget: String,
        weights: String,
        workspace: String,
        positions: usize,
        kv: String,
    },
}

/// What the model's blocks need, block by block, before any is loaded.
#[derive(Debug, Clone)]
pub struct MemoryNeeds {
    /// Loaded bytes of each block's weights, block 0 first.
    block_weights: Vec<u64>,
    /// KV bytes of one position in one block.
    block_position_bytes: u64,
    workspace: u64,
    /// Positions of one prefill step: with less KV than that the node could not take a prompt's first step.
    min_positions: usize,
}

impl MemoryNeeds {
    /// `block_weights[i]`: block `i`'s bytes once loaded; `kv_dtype_size`: bytes of one cached value; the
    /// workspace is one step of `max_chunk_tokens` at up to `cache_tokens` of context, bounded by the step memory
    /// limit, plus the receive buffers every peer together may fill.
    pub fn new(
        spec: &ModelSpec,
        block_weights: Vec<u64>,
        kv_dtype_size: usize,
        max_chunk_tokens: usize,
        cache_tokens: usize,
        limits: &ServeLimits,
    ) -> Self {
        let context = spec.max_position.min(cache_tokens.max(1));
        let mut step = step_working_bytes(spec, 1, max_chunk_tokens.max(1), context);
        if limits.max_step_bytes > 0 {
            step = step.min(limits.max_step_bytes);
        }
        Self {
            block_weights,
            block_position_bytes: spec.kv_bytes_per_token_per_block(kv_dtype_size) as u64,
            workspace: step + limits.buffer_bytes as u64,
            min_positions: max_chunk_tokens.max(1),
        }
    }

    /// The plan for a given span: weights and workspace first, then as much KV as is left, up to `cache_tokens`.
    pub fn fixed(
        &self,
        budget: Option<Budget>,
        range: BlockRange,
        cache_tokens: usize,
    ) -> Result<MemoryPlan, MemoryError> {
        let weights = self.block_weights[range.start..range.end].iter().sum();
        self.with_weights(budget, range.len(), weights, cache_tokens)
            .map_err(|(budget, positions, kv)| MemoryError::SpanTooBig {
                range,
                budget,
                weights: size(weights),
                workspace: size(self.workspace),
                positions,
                kv,
            })
    }

    /// The plan for `num_blocks` blocks wherever they are: its heaviest window must fit.
    pub fn any_window(
        &self,
        budget: Option<Budget>,
        num_blocks: usize,
        cache_tokens: usize,
    ) -> Result<MemoryPlan, MemoryError> {
        let (start, weights) = self.heaviest(num_blocks);
        self.with_weights(budget, num_blocks, weights, cache_tokens)
            .map_err(|(budget, positions, kv)| MemoryError::SpanTooBig {
                range: BlockRange::new(start, start + num_blocks),
                budget,
                weights: size(weights),
                workspace: size(self.workspace),
                positions,
                kv,
            })
    }

    /// As many blocks as fit with a KV cache of `cache_tokens` positions each (at most the model); if not even one
    /// does, one block with what KV is left, if that serves a prompt.
    pub fn most_that_fit(
        &self,
        budget: Option<Budget>,
        cache_tokens: usize,
    ) -> Result<MemoryPlan, MemoryError> {
        let Some(b) = budget else {
            return self.any_window(None, self.block_weights.len(), cache_tokens);
        };
        let full_cache = cache_tokens as u64 * self.block_position_bytes;
        let fits = (1..=self.block_weights.len())
            .take_while(|&n| {
                let need = self.heaviest(n).1 + n as u64 * full_cache + self.workspace;
                need <= b.bytes
            })
            .last();
        match fits {
            Some(n) => self.any_window(budget, n, cache_tokens),
            None => self.any_window(budget, 1, cache_tokens).map_err(|_| {
                let kv = self.min_positions as u64 * self.block_position_bytes;
                MemoryError::NoBlockFits {
                    budget: b.describe(),
                    weights: size(self.heaviest(1).1),
                    workspace: size(self.workspace),
                    positions: self.min_positions,
                    kv: size(kv),
                }
            }),
        }
    }

    /// The first of the windows of `n` consecutive blocks whose weights weigh most, and their bytes.
    fn heaviest(&self, n: usize) -> (usize, u64) {
        let n = n.clamp(1, self.block_weights.len().max(1));
        (0..=self.block_weights.len().saturating_sub(n))
            .map(|start| {
                (
                    start,
                    self.block_weights[start..start + n].iter().sum::<u64>(),
                )
            })
            .fold((0, 0), |best, w| if w.1 > best.1 { w } else { best })
    }

    /// `Err((budget, positions, kv))`: what the smallest serving cache would need, for the caller's message.
    fn with_weights(
        &self,
        budget: Option<Budget>,
        num_blocks: usize,
        weight_bytes: u64,
        cache_tokens: usize,
    ) -> Result<MemoryPlan, (String, usize, String)> {
        let position_bytes = num_blocks as u64 * self.block_position_bytes;
        let cache_tokens = match budget {
            None => cache_tokens,
            Some(b) => {
                let left = b.bytes.checked_sub(weight_bytes + self.workspace);
                let fit = left.map_or(0, |l| l / position_bytes.max(1));
                let min = self.min_positions.min(cache_tokens);
                if fit < min as u64 {
                    return Err((b.describe(), min, size(min as u64 * position_bytes)));
                }
                fit.min(cache_tokens as u64) as usize
            }
        };
        Ok(MemoryPlan {
            num_blocks,
            cache_tokens,
            weight_bytes,
            position_bytes,
            workspace_bytes: self.workspace,
            budget,
        })
    }
}

/// A byte count as people read one ("4.2 GiB").
pub fn size(bytes: u64) -> String {
    ByteSize(bytes).display().iec().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3-8B's shape.
    fn spec() -> ModelSpec {
        let config = r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}"#;
        ModelSpec::from_hf_config("8b", config).expect("a Llama config")
    }

    /// 8B-shaped needs with 4.2 GB of weights over 32 blocks, the middle ones heavier.
    fn needs() -> MemoryNeeds {
        let mut weights = vec![120 << 20; 32];
        weights[16] = 160 << 20;
        let limits = ServeLimits {
            buffer_bytes: 64 << 20,
            ..ServeLimits::default()
        };
        MemoryNeeds::new(&spec(), weights, 2, 512, 16384, &limits)
    }

    fn budget(bytes: u64) -> Option<Budget> {
        Budget::new(Some(bytes), None)
    }

    #[test]
    fn an_8k_session_of_the_8b_shape_is_one_gibibyte_in_f16() {
        let n = needs();
        let plan = n
            .fixed(None, BlockRange::new(0, 32), 8192)
            .expect("no budget");
        assert_eq!(plan.kv_bytes(), 1 << 30);
    }

    #[test]
    fn most_that_fit_takes_whole_blocks_with_a_full_cache_each() {
        let n = needs();
        let plan = n.most_that_fit(budget(2 << 30), 2048).expect("fits");
        let per_block_kv = 2048 * spec().kv_bytes_per_token_per_block(2) as u64;
        let need =
            |blocks: usize| n.heaviest(blocks).1 + blocks as u64 * per_block_kv + n.workspace;
        assert!(need(plan.num_blocks) <= 2 << 30);
        assert!(need(plan.num_blocks + 1) > 2 << 30);
        assert_eq!(plan.cache_tokens, 2048);
        // The heavy block 16 is counted wherever the window lands.
        assert!(plan.weight_bytes > plan.num_blocks as u64 * (120 << 20));
    }

    #[test]
    fn a_given_span_gets_the_kv_that_is_left_up_to_the_cap() {
        let n = needs();
        let plan = n
            .fixed(budget(3 << 30), BlockRange::new(0, 10), 1 << 30)
            .expect("fits");
        let left = (3u64 << 30) - 10 * (120 << 20) - n.workspace;
        assert_eq!(plan.cache_tokens as u64, left / plan.position_bytes);
        let capped = n
            .fixed(budget(3 << 30), BlockRange::new(0, 10), 100)
            .expect("fits");
        assert_eq!(capped.cache_tokens, 100);
    }

    #[test]
    fn a_span_that_cannot_fit_is_refused_with_its_sizes() {
        let n = needs();
        let err = n
            .fixed(budget(2 << 30), BlockRange::new(0, 32), 16384)
            .expect_err("32 blocks of 120 MiB are more than 2 GiB");
        let text = err.to_string();
        for part in ["0..32", "--max-memory 2.0 GiB", "3.8 GiB", "512 positions"] {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
    }

    #[test]
    fn no_block_fits_a_budget_below_one_block() {
        let n = needs();
        let err = n
            .most_that_fit(budget(100 << 20), 16384)
            .expect_err("too small");
        assert!(matches!(err, MemoryError::NoBlockFits { .. }), "{err}");
    }

    #[test]
    fn the_default_budget_keeps_a_margin() {
        let b = Budget::new(None, Some(20 << 30)).expect("known");
        assert_eq!(b.bytes, 18 << 30);
        assert!(!b.asked);
        let small = Budget::new(None, Some(1 << 30)).expect("known");
        assert_eq!(small.bytes, 512 << 20);
        assert_eq!(Budget::new(None, None), None);
    }
}

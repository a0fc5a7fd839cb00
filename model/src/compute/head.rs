//! The parts of the model the client keeps: token embeddings, the final norm and the LM head. Loaded without any
//! block, so a client needs only these tensors.
use crate::compute::linear::Linear;
use crate::compute::placement::{normalise, Placement};
use crate::compute::pool::on_compute_pool;
use crate::compute::rms_norm::RmsNorm;
use crate::compute::row_batcher::{BatchStats, RowBatcher};
use crate::compute::spec::ModelSpec;
use crate::compute::weights::{HeadTensor, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::{DType, Module, Tensor};
use candle_nn::Embedding;

pub struct Head {
    placement: Placement,
    embed: Embedding,
    norm: RmsNorm,
    lm_head: Linear,
    vocab_size: usize,
    /// Embeddings are multiplied by this (Gemma: `sqrt(hidden_size)`).
    embed_scale: Option<f64>,
    /// `cap * tanh(logits / cap)` (Gemma 2).
    final_softcap: Option<f64>,
    /// Concurrent sessions' last positions through the LM head as one matmul, where its kernel computes rows
    /// independently (ours, on the CPU); `None` elsewhere.
    batcher: Option<RowBatcher>,
}

impl Head {
    pub fn load(source: &dyn WeightSource, spec: &ModelSpec, placement: Placement) -> Result<Self> {
        let p = &placement;
        let missing = |t: HeadTensor| ModelError::MissingTensor {
            name: format!("{t:?}"),
        };
        let embed_w = source
            .load_head(HeadTensor::Embed, &p.device)?
            .ok_or_else(|| missing(HeadTensor::Embed))?;
        let expected = [spec.vocab_size, spec.hidden_size];
        if embed_w.dims() != expected {
            return Err(ModelError::TensorShape {
                name: "token embeddings".into(),
                expected: expected.to_vec(),
                actual: embed_w.dims(),
            });
        }
        let norm_w = source
            .load_head(HeadTensor::FinalNorm, &p.device)?
            .ok_or_else(|| missing(HeadTensor::FinalNorm))?;
        // Without its own LM head the model ties it to the embeddings; a quantized embedding stays quantized for
        // the LM head matmul (as llama.cpp and candle's quantized_llama do), and is dequantized for lookups.
        let lm_head = match source.load_head(HeadTensor::LmHead, &p.device)? {
            Some(w) => w.matmul(p)?,
            None => embed_w.matmul(p)?,
        }
        .for_logits();
        let o = &spec.options;
        let norm_w = norm_w.norm(p, o.norm_plus_one)?;
        Ok(Self {
            embed: Embedding::new(embed_w.dense(p)?, spec.hidden_size),
            norm: RmsNorm::new(norm_w, spec.rms_eps),
            vocab_size: spec.vocab_size,
            embed_scale: o.scale_embeddings.then(|| (spec.hidden_size as f64).sqrt()),
            final_softcap: o.final_softcap,
            batcher: (p.device.is_cpu() && lm_head.rows_independent()).then(RowBatcher::new),
            lm_head,
            placement,
        })
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Hidden states `[1, tokens, hidden]` for token ids.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let _span = tracing::trace_span!("embed", tokens = ids.len()).entered();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(ModelError::Tokenizer(format!(
                "token id {bad} is outside the model's vocabulary of {}",
                self.vocab_size
            )));
        }
        let ids = Tensor::new(ids, &self.placement.device)?.unsqueeze(0)?;
        let x = self.embed.forward(&ids)?;
        Ok(match self.embed_scale {
            // In the embeddings' dtype, as the reference scales them.
            Some(s) => (x * s)?,
            None => x,
        })
    }

    /// f32 logits `[batch, vocab]` of the last position of `hidden` (`[batch, tokens, hidden]`), from wherever the
    /// last block left it. Callers on several threads at once share one LM head matmul where it allows.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let last = self.last_position(hidden)?;
        match &self.batcher {
            // From a thread of the compute pool, waiting for another caller's batch could hold a thread that
            // batch needs.
            Some(batcher) if rayon::current_thread_index().is_none() => {
                batcher.run(0, last, |x| self.project(x))
            }
            _ => self.project(&last),
        }
    }

    /// [`Head::logits`] from an async task, for `caller` (a session, unique among those alive): the callers of one
    /// shared matmul tend to come back together for the next, and it waits a little for those that have not yet.
    /// It waits without holding a thread, and runs synchronous compute (its own rows alone, or a batch it computes
    /// for the others) through `blocking`, which must run the closure on the calling thread without stalling the
    /// runtime (tokio's `block_in_place`).
    pub async fn logits_async(
        &self,
        caller: u64,
        hidden: &Tensor,
        blocking: impl Fn(&mut dyn FnMut()),
    ) -> Result<Tensor> {
        let last = self.last_position(hidden)?;
        let project = |x: &Tensor| self.project(x);
        match &self.batcher {
            Some(batcher) => batcher.run_async(caller, last, project, blocking).await,
            None => {
                let mut logits = None;
                blocking(&mut || logits = Some(project(&last)));
                logits.unwrap_or_else(|| Err(ModelError::Config("the head did not run".into())))
            }
        }
    }

    /// The last position of `hidden` (`[batch, tokens, hidden]`) as `[batch, hidden]`, on the head's placement.
    fn last_position(&self, hidden: &Tensor) -> Result<Tensor> {
        let (_, tokens, _) = hidden.dims3()?;
        if tokens == 0 {
            return Err(ModelError::HiddenShape {
                actual: hidden.dims().to_vec(),
                hidden_size: self.embed.hidden_size(),
            });
        }
        // The norm is by position: only the last one's is needed.
        normalise(
            &hidden.narrow(1, tokens - 1, 1)?.squeeze(1)?,
            &self.placement,
        )
    }

    /// What the LM head's row batching has done: `None` where it does not batch.
    pub fn batch_stats(&self) -> Option<BatchStats> {
        self.batcher.as_ref().map(RowBatcher::stats)
    }

    /// Final norm and LM head of `[rows, hidden]` last positions (one caller's or a batch's), on the compute pool.
    fn project(&self, last: &Tensor) -> Result<Tensor> {
        let _span = tracing::trace_span!("head", rows = last.dim(0)?).entered();
        on_compute_pool(&self.placement.device, || self.project_here(last))
    }

    fn project_here(&self, last: &Tensor) -> Result<Tensor> {
        let x = self.norm.forward(&last.contiguous()?)?;
        let logits = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
        Ok(match self.final_softcap {
            Some(cap) => ((logits / cap)?.tanh()? * cap)?,
            None => logits,
        })
    }
}

//! The parts of the model the client keeps: token embeddings, the final norm and the LM head. Loaded without any
//! block, so a client needs only these tensors.
use crate::compute::linear::Linear;
use crate::compute::placement::{normalise, Placement};
use crate::compute::pool::on_compute_pool;
use crate::compute::spec::ModelSpec;
use crate::compute::weights::{HeadTensor, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::{DType, IndexOp, Module, Tensor};
use candle_nn::{Embedding, RmsNorm};

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
        };
        let o = &spec.options;
        let norm_w = norm_w.norm(p, o.norm_plus_one)?;
        Ok(Self {
            embed: Embedding::new(embed_w.dense(p)?, spec.hidden_size),
            norm: RmsNorm::new(norm_w, spec.rms_eps),
            lm_head,
            vocab_size: spec.vocab_size,
            embed_scale: o.scale_embeddings.then(|| (spec.hidden_size as f64).sqrt()),
            final_softcap: o.final_softcap,
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
    /// last block left it.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        on_compute_pool(&self.placement.device, || self.logits_here(hidden))
    }

    fn logits_here(&self, hidden: &Tensor) -> Result<Tensor> {
        let _span = tracing::trace_span!("head").entered();
        let hidden = normalise(hidden, &self.placement)?;
        let (_, tokens, _) = hidden.dims3()?;
        let x = self.norm.forward(&hidden)?;
        let x = x.i((.., tokens - 1, ..))?.contiguous()?;
        let logits = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
        Ok(match self.final_softcap {
            Some(cap) => ((logits / cap)?.tanh()? * cap)?,
            None => logits,
        })
    }
}

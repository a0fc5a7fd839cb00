//! One block's keys and values for one session, on that block's device and dtype.
use crate::compute::placement::{normalise, Placement};
use crate::error::Result;
use candle_core::Tensor;

/// Keys and values of shape `[batch, kv_heads, positions, head_dim]`.
#[derive(Debug, Clone)]
pub struct KvCache {
    placement: Placement,
    kv: Option<(Tensor, Tensor)>,
}

impl KvCache {
    pub fn new(placement: Placement) -> Self {
        Self {
            placement,
            kv: None,
        }
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map(|(k, _)| k.dims()[2]).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of device memory the cache holds.
    pub fn bytes(&self) -> usize {
        self.kv
            .as_ref()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .unwrap_or(0)
    }

    /// Appends new keys/values and returns everything held. The new tensors are normalised to the cache's
    /// placement first, so a key computed elsewhere can never be concatenated across devices or dtypes.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let k = normalise(k, &self.placement)?;
        let v = normalise(v, &self.placement)?;
        let (k, v) = match &self.kv {
            None => (k.contiguous()?, v.contiguous()?),
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
        };
        self.kv = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    /// Replaces the contents with keys/values restored from elsewhere (a snapshot, another node, a replay),
    /// normalised to this cache's placement whatever device and dtype they arrive in.
    pub fn restore(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.kv = Some((
            normalise(k, &self.placement)?.contiguous()?,
            normalise(v, &self.placement)?.contiguous()?,
        ));
        Ok(())
    }

    /// The keys and values held, for snapshots and tests.
    pub fn snapshot(&self) -> Option<(Tensor, Tensor)> {
        self.kv.clone()
    }

    pub fn clear(&mut self) {
        self.kv = None;
    }
}

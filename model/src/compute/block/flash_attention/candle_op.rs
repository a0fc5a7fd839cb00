//! [`FlashAttention`] as a candle op (`CustomOp3`): queries, keys and values as tensors on the CPU, checked and
//! read as the kernel's slices and cache views.
use super::cache::cache_view;
use super::FlashAttention;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape};

fn f32_slice<'a>(s: &'a CpuStorage, what: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        other => candle_core::bail!("flash attention: {what} are {:?}, not f32", other.dtype()),
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "petal-flash-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = ql.contiguous_offsets() else {
            candle_core::bail!("flash attention: queries must be contiguous");
        };
        let q = &f32_slice(qs, "queries")?[start..end];
        let dims: [usize; 5] = match ql.dims() {
            &[b, h, g, t, d] if g == self.group => [b, h, g, t, d],
            other => {
                candle_core::bail!("flash attention: queries {other:?}, group {}", self.group)
            }
        };
        let [b, h, _, _, d] = dims;
        let (k, len) = cache_view(ks, kl, "keys", (b, h, d))?;
        let (v, vlen) = cache_view(vs, vl, "values", (b, h, d))?;
        if vlen != len || len < self.position + dims[3] {
            candle_core::bail!(
                "flash attention: {len} keys and {vlen} values for {} tokens at position {}",
                dims[3],
                self.position
            );
        }
        let mut out = vec![0f32; q.len()];
        self.compute(q, dims, (k, v), len, &mut out);
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }
}

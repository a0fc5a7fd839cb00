//! SwiGLU's `silu(gate) * up` in one pass over the stacked gate/up projection's output, on the CPU.
//!
//! Done as candle ops, this is a strided copy of each half, a SiLU and a product, each allocating its output and
//! each a parallel region of its own: for a batch of 16 decode rows it cost as much as the down projection's
//! matmul. Here each row is read once and written once, in one parallel region. Each value is computed exactly as
//! candle's `silu` then `mul` compute it (`g / (1 + exp(-g))`, then times `u`, no fused multiply-add), so results
//! do not change.
use crate::error::Result;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

/// `silu(y[..., :width]) * y[..., width..]` for `y` of last dimension `2 * width`.
pub fn silu_mul(y: &Tensor, width: usize) -> Result<Tensor> {
    if y.device().is_cpu() && y.dtype() == DType::F32 {
        return Ok(y.contiguous()?.apply_op1_no_bwd(&SiluMul { width })?);
    }
    let gate = y.narrow(D::Minus1, 0, width)?;
    let up = y.narrow(D::Minus1, width, width)?;
    Ok((candle_nn::ops::silu(&gate)? * up)?)
}

/// The CPU op behind [`silu_mul`].
struct SiluMul {
    width: usize,
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "petal-silu-mul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let w = self.width;
        let dims = layout.dims();
        if w == 0 || dims.last() != Some(&(2 * w)) {
            candle_core::bail!("silu-mul: input {dims:?} is not two halves of {w}");
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("silu-mul: input must be contiguous");
        };
        let y = &storage.as_slice::<f32>()?[start..end];
        let mut out = vec![0f32; y.len() / 2];
        out.par_chunks_mut(w)
            .zip(y.par_chunks(2 * w))
            .for_each(|(out, row)| {
                let (gate, up) = row.split_at(w);
                silu_mul_row(gate, up, out);
            });
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = w;
        }
        Ok((CpuStorage::F32(out), Shape::from(out_dims)))
    }
}

/// `out = silu(gate) * up`, value by value.
fn silu_mul_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let done =
        if crate::compute::linear::cpu_features().avx2 && super::libm_exp::vector_matches_libm() {
            // SAFETY: AVX2 and FMA checked just above.
            unsafe { avx2::silu_mul(gate, up, out) }
        } else {
            0
        };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for ((o, &g), &u) in out[done..].iter_mut().zip(&gate[done..]).zip(&up[done..]) {
        *o = silu_times(g, u);
    }
}

/// candle's `silu(g) * u` for one value.
#[inline]
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::libm_exp::avx2::exp8;
    use std::arch::x86_64::*;

    /// [`super::silu_mul_row`] eight values at a time, with [`exp8`]; returns how many values it wrote (all but a
    /// tail of fewer than eight).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let n = gate.len().min(up.len()).min(out.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let minus = _mm256_xor_ps(g, _mm256_set1_ps(-0.0));
            match exp8(minus) {
                // The same three IEEE operations as the scalar form, in its order.
                Some(e) => {
                    let denominator = _mm256_add_ps(_mm256_set1_ps(1.0), e);
                    let v = _mm256_mul_ps(_mm256_div_ps(g, denominator), u);
                    _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
                }
                None => {
                    for j in i..i + 8 {
                        out[j] = super::silu_times(gate[j], up[j]);
                    }
                }
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn equals_candles_silu_times_up_bit_for_bit() {
        let y = crate::compute::linear::test_matrix(5, 2 * 96, 3)
            .affine(8.0, -4.0)
            .unwrap()
            .reshape((1, 5, 192))
            .unwrap();
        let gate = y.narrow(D::Minus1, 0, 96).unwrap();
        let up = y.narrow(D::Minus1, 96, 96).unwrap();
        let want = (candle_nn::ops::silu(&gate).unwrap() * up).unwrap();
        let got = silu_mul(&y, 96).unwrap();
        assert_eq!(got.dims(), &[1, 5, 96]);
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        };
        assert_eq!(bits(&got), bits(&want));
        // Other dtypes take candle's ops.
        let half = y.to_dtype(DType::F16).unwrap();
        assert_eq!(silu_mul(&half, 96).unwrap().dtype(), DType::F16);
        let bad = Tensor::zeros((2, 7), DType::F32, &Device::Cpu).unwrap();
        assert!(silu_mul(&bad, 4).is_err());
    }

    #[test]
    fn large_values_and_tails_equal_candles_too() {
        // Gates over [-120, 120]: some past 88, where exp over- or underflows and eight lanes go back to the scalar
        // exp; 101 values a row, so each row ends in a tail of five.
        let y = crate::compute::linear::test_matrix(7, 2 * 101, 11)
            .affine(240.0, 0.0)
            .unwrap()
            .reshape((1, 7, 202))
            .unwrap();
        let gate = y.narrow(D::Minus1, 0, 101).unwrap();
        let up = y.narrow(D::Minus1, 101, 101).unwrap();
        let want: Vec<f32> = (candle_nn::ops::silu(&gate).unwrap() * up)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let got: Vec<f32> = silu_mul(&y, 101)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let g: Vec<f32> = gate.flatten_all().unwrap().to_vec1().unwrap();
        assert!(g.iter().any(|v| v.abs() >= 88.0) && g.iter().any(|v| v.abs() < 88.0));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "value {i}: {a} vs {b}");
        }
    }
}

//! RMSNorm, with the rows of a batch normalised side by side on the CPU.
//!
//! candle's CPU RMSNorm adds each row's squares one after another, a chain of dependent additions (576 for
//! SmolLM2, four cycles each), and takes up to 32 rows on one thread: a 16-session batch's two norms per block
//! cost 15 us each while the pool's other thread waited. Here up to [`LANES`] rows are summed at once, one per
//! vector lane, each lane still adding its row's squares in order, so every sum, and every output, is candle's bit
//! for bit. Everything else (one row, other dtypes and devices, views) goes to candle's op.
use crate::error::Result;
use candle_core::{CpuStorage, Device, Module, Storage, Tensor};
use rayon::prelude::*;

/// Rows normalised side by side: one 512-bit vector of f32 sums.
const LANES: usize = 16;

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension; see the module docs.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    inner: candle_nn::RmsNorm,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self {
            inner: candle_nn::RmsNorm::new(weight, eps),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.side_by_side(x)? {
            return Ok(y);
        }
        Ok(self.inner.forward(x)?)
    }

    /// The norm of several f32 rows on the CPU, side by side; `None` where candle's op should run instead.
    fn side_by_side(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let n = x.dim(candle_core::D::Minus1)?;
        if !x.device().is_cpu() || n == 0 || x.elem_count() / n < 2 {
            return Ok(None);
        }
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = self.inner.weight().storage_and_layout();
        let (Storage::Cpu(CpuStorage::F32(xs)), Storage::Cpu(CpuStorage::F32(ws))) = (&*xs, &*ws)
        else {
            return Ok(None);
        };
        let (Some((x0, x1)), Some((w0, w1))) = (xl.contiguous_offsets(), wl.contiguous_offsets())
        else {
            return Ok(None);
        };
        let (src, alpha) = (&xs[x0..x1], &ws[w0..w1]);
        if alpha.len() != n {
            return Ok(None);
        }
        let mut dst = vec![0f32; src.len()];
        // In f32, as candle's op takes it.
        normalise_rows(src, alpha, self.inner.eps() as f32, &mut dst);
        Ok(Some(Tensor::from_vec(dst, x.shape(), &Device::Cpu)?))
    }
}

/// `dst[r] = src[r] / m[r] * alpha` for every row `r` of `alpha.len()` values, `m[r] = sqrt(sum of src[r]^2 in
/// order / n + eps)`: candle's arithmetic, [`LANES`] rows per task.
fn normalise_rows(src: &[f32], alpha: &[f32], eps: f32, dst: &mut [f32]) {
    let n = alpha.len();
    src.par_chunks(LANES * n)
        .zip(dst.par_chunks_mut(LANES * n))
        .for_each(|(src, dst)| {
            let sums = squares(src, n);
            for ((src, dst), sum) in src.chunks(n).zip(dst.chunks_mut(n)).zip(sums) {
                let m = (sum / n as f32 + eps).sqrt();
                for ((d, s), a) in dst.iter_mut().zip(src).zip(alpha) {
                    *d = *s / m * *a;
                }
            }
        });
}

/// Each row's sum of squares (rows of `n` values, at most [`LANES`] of them), added in order from the first value,
/// as `iter().map(|v| v * v).sum::<f32>()` adds them.
fn squares(rows: &[f32], n: usize) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    // The gather's offsets are 32-bit: every row's start must fit.
    let offsets_fit = n <= i32::MAX as usize / LANES;
    if rows.len() == LANES * n && offsets_fit && super::linear::cpu_features().avx512_vnni {
        // SAFETY: AVX-512 is present (F is all this needs); the slice holds LANES rows of n values, and row
        // LANES - 1's start, (LANES - 1) * n, fits an i32.
        return unsafe { squares_avx512(rows, n) };
    }
    // std's float sum starts from -0.0; the first addition gives the first square exactly either way.
    let mut sums = [-0.0f32; LANES];
    for (row, sum) in rows.chunks(n).zip(sums.iter_mut()) {
        *sum = row.iter().map(|v| v * v).sum::<f32>();
    }
    sums
}

/// [`squares`] of [`LANES`] rows at once: lane `r` gathers row `r`'s value `j` at step `j`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn squares_avx512(rows: &[f32], n: usize) -> [f32; LANES] {
    use std::arch::x86_64::*;
    let stride = n as i32;
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(stride));
    let mut acc = _mm512_set1_ps(-0.0);
    let base = rows.as_ptr();
    for j in 0..n {
        let v = _mm512_i32gather_ps::<4>(offsets, base.add(j));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    let mut sums = [0f32; LANES];
    _mm512_storeu_ps(sums.as_mut_ptr(), acc);
    sums
}

#[cfg(test)]
mod tests {
    use super::RmsNorm;
    use crate::compute::linear::test_matrix;
    use candle_core::{DType, Module, Tensor};

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn equals_candle_bit_for_bit_for_any_number_of_rows() {
        for n in [576, 64, 7] {
            let weight = (test_matrix(1, n, 3).reshape(n).unwrap() + 1.0).unwrap();
            let ours = RmsNorm::new(weight.clone(), 1e-5);
            let candle = candle_nn::RmsNorm::new(weight, 1e-5);
            // A lone row, a partial group, a whole group of lanes, and groups plus a remainder.
            for rows in [1, 2, 5, 16, 17, 40] {
                let x = (test_matrix(rows, n, rows as u64) * 30.0).unwrap();
                for x in [x.clone(), x.reshape((1, rows, n)).unwrap()] {
                    let (want, got) = (candle.forward(&x).unwrap(), ours.forward(&x).unwrap());
                    assert_eq!(got.dims(), want.dims());
                    assert_eq!(bits(&got), bits(&want), "{rows} rows of {n}");
                }
            }
        }
    }

    #[test]
    fn views_and_other_dtypes_give_candles_result() {
        let n = 64;
        let weight = test_matrix(1, n, 1).reshape(n).unwrap();
        let view = test_matrix(n, 8, 2).t().unwrap();
        assert!(!view.is_contiguous());
        let (ours, candle) = (
            RmsNorm::new(weight.clone(), 1e-6),
            candle_nn::RmsNorm::new(weight.clone(), 1e-6),
        );
        assert_eq!(
            bits(&ours.forward(&view).unwrap()),
            bits(&candle.forward(&view).unwrap())
        );
        let half = weight.to_dtype(DType::F16).unwrap();
        let (ours, candle) = (
            RmsNorm::new(half.clone(), 1e-6),
            candle_nn::RmsNorm::new(half, 1e-6),
        );
        let x = test_matrix(8, n, 4).to_dtype(DType::F16).unwrap();
        let widened = |t: Tensor| t.to_dtype(DType::F32).unwrap();
        assert_eq!(
            bits(&widened(ours.forward(&x).unwrap())),
            bits(&widened(candle.forward(&x).unwrap()))
        );
    }
}

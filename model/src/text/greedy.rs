//! Greedy choice: the index of the largest logit, as candle's `argmax` picks it, without its scalar scan.
//!
//! Every greedy step of every session pays it once over the whole vocabulary: through candle (a copy of the row,
//! then a compare-and-branch per entry) it cost 30–40 µs for SmolLM2's 49,152 logits, about 0.5 ms of CPU per
//! 16-session round. Here the maximum is found over 16 lanes at once and its first position in a second pass,
//! about 6 µs.
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use crate::error::{ModelError, Result};

/// Lanes of the maximum's first pass: one AVX-512 register of f32, two AVX2 ones.
const LANES: usize = 16;

/// Values tested at once for the maximum's first position.
const SEARCH_CHUNK: usize = 64;

/// The index candle's `argmax` returns for `values`: the first position of the largest value, NaNs skipped
/// (`-0.0` and `0.0` equal), except that a NaN first value wins (candle's scan starts from it and no comparison
/// with NaN replaces it). `None` for an empty slice.
pub fn argmax_of(values: &[f32]) -> Option<u32> {
    let &first = values.first()?;
    if first.is_nan() {
        return Some(0);
    }
    // `x > m` is false for a NaN `x`: NaNs never become the maximum, as in candle's scan.
    let larger = |m: f32, x: f32| if x > m { x } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = larger(*m, x);
        }
    }
    let max = lanes
        .into_iter()
        .chain(rest.iter().copied())
        .fold(f32::NEG_INFINITY, larger);
    // `first` is not NaN, so `max >= first` and some value equals it: the first such is candle's answer (its scan
    // replaces the running value only by a strictly larger one).
    // Whole chunks are tested branch-free (so the test vectorises), then the hit's chunk, or the remainder, is
    // searched one by one.
    let chunk = values
        .chunks_exact(SEARCH_CHUNK)
        .position(|c| c.iter().fold(0u32, |hits, &x| hits | u32::from(x == max)) != 0)
        .unwrap_or(values.len() / SEARCH_CHUNK);
    let from = chunk * SEARCH_CHUNK;
    let within = values[from..].iter().position(|&x| x == max)?;
    Some((from + within) as u32)
}

/// [`argmax_of`] over `logits` (one row of any shape, any dtype, any device), read in place when they are
/// contiguous f32 on the CPU.
pub fn argmax(logits: &Tensor) -> Result<u32> {
    let empty = || ModelError::Sampling("cannot pick a token from empty logits".into());
    if logits.device().is_cpu() && logits.dtype() == DType::F32 {
        let (storage, layout) = logits.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return argmax_of(&data[start..end]).ok_or_else(empty);
        }
    }
    let values = logits
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    argmax_of(&values).ok_or_else(empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// candle's own answer, the reference.
    fn candle_argmax(values: &[f32]) -> u32 {
        Tensor::new(values, &Device::Cpu)
            .unwrap()
            .argmax(0)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap()
    }

    #[test]
    fn picks_what_candle_picks() {
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let cases: Vec<Vec<f32>> = vec![
            vec![1.0],
            vec![nan],
            vec![nan, 5.0, 7.0],
            vec![1.0, nan, 3.0, nan],
            vec![-inf, nan, -inf],
            vec![-inf, -inf],
            vec![-0.0, 0.0, -0.0],
            vec![0.0, -0.0],
            vec![3.0, 1.0, 3.0, 3.0],
            vec![1.0, inf, 2.0, inf],
            vec![-5.0; 40],
        ];
        for case in &cases {
            assert_eq!(argmax_of(case), Some(candle_argmax(case)), "{case:?}");
        }
        // Long rows with ties, NaNs and the maximum in every lane and in the remainder.
        let mut seed = 7u32;
        for len in [15, 16, 17, 33, 65, 130, 49_152, 49_157] {
            for _ in 0..20 {
                let values: Vec<f32> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        match seed >> 28 {
                            0 => nan,
                            1 => 12.0,
                            _ => ((seed >> 8) % 2000) as f32 / 200.0 - 5.0,
                        }
                    })
                    .collect();
                assert_eq!(argmax_of(&values), Some(candle_argmax(&values)), "{len}");
            }
        }
        assert_eq!(argmax_of(&[]), None);
    }

    #[test]
    fn reads_any_tensor() {
        let rows = Tensor::new(&[[1f32, 9.0, 2.0], [4.0, 3.0, 8.0]], &Device::Cpu).unwrap();
        assert_eq!(argmax(&rows.get(1).unwrap()).unwrap(), 2);
        // A column is not contiguous; f16 is converted.
        assert_eq!(argmax(&rows.narrow(1, 1, 1).unwrap()).unwrap(), 0);
        let half = rows.get(0).unwrap().to_dtype(DType::F16).unwrap();
        assert_eq!(argmax(&half).unwrap(), 1);
        let empty = Tensor::zeros(0, DType::F32, &Device::Cpu).unwrap();
        assert!(argmax(&empty).is_err());
    }
}

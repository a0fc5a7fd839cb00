//! Candle's quantized CPU matmul for the formats our kernels do not take (the K-quants), run on the
//! calling compute pool's threads: the matrix's rows in parts, one task of the pool per part, each part's product
//! candle's own.
//!
//! Why: candle runs each matmul on a pool of its own (`CANDLE_NUM_THREADS` threads, its `BarrierPool`), beside ours.
//! On a small machine the two pools' threads take turns on the same cores: candle's workers spin after every
//! matmul on the cores our pool needs next, or, told not to spin, are woken for every matmul. The binaries keep
//! candle's pool to the calling thread (`pool::keep_candle_on_our_threads`) and these parts spread its kernels over
//! our threads instead. A part holds a multiple of [`PART_ROWS`] rows, so that candle's tiled kernels (sixteen
//! weight rows a tile) see the same tiles as in the whole matrix: every output is the whole matrix's, bit for bit.
//! Without that setting, parts still give the same results: candle's pool takes one call at a time.
use crate::error::Result;
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Arc;

/// Rows of a part: a multiple of candle's x86 tile (sixteen weight rows).
pub const PART_ROWS: usize = 16;

/// A `[rows, cols]` quantized matrix in row parts, candle computing each.
#[derive(Debug)]
pub struct CandleRows {
    parts: Vec<QMatMul>,
}

impl CandleRows {
    /// `q` (a quantized 2-D matrix on the CPU) in `parts` parts of whole tiles of rows, or `None` when it is not
    /// one, when fewer than two parts would have rows, or when candle would not keep it quantized.
    pub fn new(q: &QTensor, parts: usize) -> Result<Option<Self>> {
        let dims = q.shape().dims();
        let [rows, cols] = *dims else {
            return Ok(None);
        };
        let tiles = rows / PART_ROWS;
        let parts = parts.min(tiles);
        if parts < 2 || !rows.is_multiple_of(PART_ROWS) || !q.device().is_cpu() {
            return Ok(None);
        }
        let dtype = q.dtype();
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let data = q.data()?;
        let mut matmuls = Vec::with_capacity(parts);
        let mut start = 0;
        for part in 0..parts {
            // Tiles shared out as evenly as they go, the first parts taking one more.
            let n = (tiles / parts + usize::from(part < tiles % parts)) * PART_ROWS;
            let bytes = data[start * row_bytes..(start + n) * row_bytes].to_vec();
            let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
            let matmul = QMatMul::from_arc(Arc::new(QTensor::new(storage, (n, cols))?))?;
            if !matches!(matmul, QMatMul::QTensor(_)) {
                // A format candle computes dequantized: nothing of its pool to spread.
                return Ok(None);
            }
            matmuls.push(matmul);
            start += n;
        }
        Ok(Some(Self { parts: matmuls }))
    }

    /// `x`: `[..., cols]` to `[..., rows]`, the parts computed side by side on the calling thread's pool.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let outputs = self
            .parts
            .par_iter()
            .map(|part| part.forward(x))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&outputs, x.rank() - 1)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::linear::test_matrix;
    use candle_core::quantized::GgmlDType;

    /// Every format candle keeps quantized gives, in parts, what the whole matrix gives, bit for bit, for one row
    /// (its vector products) and for several (its tiles).
    #[test]
    fn parts_give_the_whole_matrix_products() {
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5K,
            GgmlDType::Q3K,
            GgmlDType::Q2K,
        ] {
            let q = Arc::new(QTensor::quantize(&test_matrix(80, 512, 3), dtype).unwrap());
            let whole = QMatMul::from_arc(q.clone()).unwrap();
            for parts in [2, 3] {
                let split = CandleRows::new(&q, parts).unwrap().unwrap();
                assert_eq!(split.parts.len(), parts);
                for rows in [1, 3, 16, 33] {
                    let x = test_matrix(rows, 512, rows as u64)
                        .reshape((1, rows, 512))
                        .unwrap();
                    let bits = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let got = split.forward(&x).unwrap();
                    assert_eq!(got.dims(), &[1, rows, 80]);
                    assert_eq!(
                        bits(got),
                        bits(whole.forward(&x).unwrap()),
                        "{dtype:?}, {parts} parts, {rows} rows"
                    );
                }
            }
        }
    }

    #[test]
    fn only_matrices_of_whole_tiles_and_two_parts_are_split() {
        let q =
            |rows: usize| QTensor::quantize(&test_matrix(rows, 256, 1), GgmlDType::Q4K).unwrap();
        assert!(CandleRows::new(&q(16), 2).unwrap().is_none(), "one tile");
        assert!(
            CandleRows::new(&q(40), 2).unwrap().is_none(),
            "not whole tiles"
        );
        assert!(CandleRows::new(&q(32), 1).unwrap().is_none(), "one part");
        let three = CandleRows::new(&q(48), 8).unwrap().unwrap();
        assert_eq!(three.parts.len(), 3, "no more parts than tiles");
    }
}

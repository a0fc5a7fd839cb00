//! Several matmuls over the same input (queries, keys and values; gate and up) run as one where the weights allow:
//! the input is quantized once and the threads are woken once (on a GPU: one launch instead of two per part, and
//! launches are what bound a GPU's decode step). Rows of a stacked matrix are computed exactly as they would be
//! alone, so results do not change.
use super::{
    Linear, Q4KMatrix, Q4_0Matrix, Q4_1Matrix, Q5KMatrix, Q5_0Matrix, Q5_1Matrix, Q6KMatrix,
    Repacked,
};
use crate::error::Result;
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::Tensor;
use std::borrow::Cow;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum Stacked {
    /// One matrix whose output splits into parts of these widths.
    One(Linear, Vec<usize>),
    /// Weights that cannot be stacked (candle's formats on the CPU, dense weights, parts of different formats or
    /// widths), run one after another.
    Many(Vec<Linear>),
}

impl Stacked {
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        // Each of our formats: parts all in it become one matrix of it.
        macro_rules! stack_format {
            ($variant:ident, $matrix:ty) => {
                if let Some(stacked) = stack_ours(
                    &parts,
                    |p| match p {
                        Linear::$variant(m) => Some(m),
                        _ => None,
                    },
                    (<$matrix>::concat_rows, <$matrix>::rows, Linear::$variant),
                )? {
                    return Ok(stacked);
                }
            };
        }
        stack_format!(Q4_0, Q4_0Matrix);
        stack_format!(Q4_1, Q4_1Matrix);
        stack_format!(Q5_0, Q5_0Matrix);
        stack_format!(Q5_1, Q5_1Matrix);
        stack_format!(Q4K, Q4KMatrix);
        stack_format!(Q5K, Q5KMatrix);
        stack_format!(Q6K, Q6KMatrix);
        // candle's quantized matrices on a GPU (on the CPU, the formats our kernels take are stacked above).
        let on_gpu: Vec<&QTensor> = parts
            .iter()
            .filter_map(|p| match p {
                Linear::Candle(QMatMul::QTensor(q)) if !q.device().is_cpu() => Some(q.as_ref()),
                _ => None,
            })
            .collect();
        if on_gpu.len() == parts.len() {
            if let Some((stacked, widths)) = stack_rows(&on_gpu)? {
                return Ok(Self::One(
                    Linear::Candle(QMatMul::from_arc(Arc::new(stacked))?),
                    widths,
                ));
            }
        }
        Ok(Self::Many(parts))
    }

    /// One matrix already holding the parts' rows one after another (a file's fused q/k/v or gate/up).
    pub fn split(fused: Linear, widths: Vec<usize>) -> Self {
        Self::One(fused, widths)
    }

    /// The one matrix of two parts of equal width, and that width: its output can be used whole.
    pub fn halves(&self) -> Option<(&Linear, usize)> {
        match self {
            Self::One(linear, widths) if widths.len() == 2 && widths[0] == widths[1] => {
                Some((linear, widths[0]))
            }
            _ => None,
        }
    }

    /// Each part's output for `x` (`[..., in]`), in order.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Self::Many(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            Self::One(linear, widths) => {
                let y = linear.forward(x)?;
                let last = y.rank() - 1;
                let mut start = 0;
                widths
                    .iter()
                    .map(|&w| {
                        let part = y.narrow(last, start, w)?;
                        start += w;
                        Ok(part)
                    })
                    .collect()
            }
        }
    }
}

/// How one of our kernels' matrix types stacks: its `concat_rows`, its `rows` and its [`Linear`] variant.
type StackFns<M> = (
    fn(&[&M]) -> Result<M>,
    fn(&M) -> usize,
    fn(Arc<M>) -> Linear,
);

/// Two or more parts all in one of our kernels' formats (`pick` gives a part's matrix in it) as one matrix, split
/// by each part's rows; `None` when they are not.
fn stack_ours<M>(
    parts: &[Linear],
    pick: impl Fn(&Linear) -> Option<&Arc<M>>,
    (concat, rows, wrap): StackFns<M>,
) -> Result<Option<Stacked>> {
    let ours: Vec<&M> = parts
        .iter()
        .filter_map(|p| pick(p).map(Arc::as_ref))
        .collect();
    if parts.len() < 2 || ours.len() != parts.len() {
        return Ok(None);
    }
    let widths = ours.iter().map(|m| rows(m)).collect();
    Ok(Some(Stacked::One(wrap(Arc::new(concat(&ours)?)), widths)))
}

/// Quantized matrices of one format and width as one, their rows one after another (a row's blocks are its own, so
/// the bytes are simply laid end to end), and each part's rows; `None` when they differ in format or width, or
/// there is only one.
fn stack_rows(parts: &[&QTensor]) -> Result<Option<(QTensor, Vec<usize>)>> {
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    let (dtype, device) = (first.dtype(), first.device());
    let cols = first.shape().dims().get(1).copied();
    let alike = parts.iter().all(|q| {
        q.rank() == 2
            && q.dtype() == dtype
            && q.shape().dims().get(1).copied() == cols
            && q.device().same_device(&device)
    });
    let (true, Some(cols), 2..) = (alike, cols, parts.len()) else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    let mut widths = Vec::with_capacity(parts.len());
    for q in parts {
        bytes.extend_from_slice(&q.data()?);
        widths.push(q.shape().dims()[0]);
    }
    let rows = widths.iter().sum::<usize>();
    let storage = QStorage::from_data(Cow::Owned(bytes), &device, dtype)?;
    Ok(Some((QTensor::new(storage, (rows, cols))?, widths)))
}

#[cfg(test)]
mod tests {
    use super::stack_rows;
    use crate::compute::linear::test_matrix;
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Module, Tensor};
    use std::sync::Arc;

    /// Stacked quantized matrices give each part's products bit for bit, on the CPU and, where there is one, on a
    /// GPU (where [`super::Stacked::new`] stacks them).
    #[test]
    fn stacked_quantized_rows_give_each_parts_products() {
        for device in crate::compute::placement::test_devices() {
            let matrix = |rows: usize, seed: u64| {
                let w = test_matrix(rows, 256, seed);
                Arc::new(QTensor::quantize_onto(&w, GgmlDType::Q4_1, &device).unwrap())
            };
            let parts = [matrix(64, 1), matrix(32, 2), matrix(32, 3)];
            let refs: Vec<&QTensor> = parts.iter().map(Arc::as_ref).collect();
            let (stacked, widths) = stack_rows(&refs).unwrap().unwrap();
            assert_eq!(widths, [64, 32, 32]);
            assert_eq!(stacked.shape().dims(), [128, 256]);
            assert!(stacked.device().same_device(&device));
            let whole = QMatMul::from_arc(Arc::new(stacked)).unwrap();
            let bits = |t: &Tensor| {
                t.contiguous()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            for rows in [1, 3, 16] {
                let x = test_matrix(rows, 256, 9).to_device(&device).unwrap();
                let y = whole.forward(&x).unwrap();
                let mut start = 0;
                for (part, &width) in parts.iter().zip(&widths) {
                    let alone = QMatMul::from_arc(part.clone())
                        .unwrap()
                        .forward(&x)
                        .unwrap();
                    let mine = y.narrow(1, start, width).unwrap();
                    assert_eq!(bits(&mine), bits(&alone), "{device:?}, {rows} rows");
                    start += width;
                }
            }
        }
        // Different widths or formats are not stacked, nor is a lone matrix.
        let quantized = |cols: usize, dtype: GgmlDType| {
            QTensor::quantize(&test_matrix(32, cols, 4), dtype).unwrap()
        };
        let first = quantized(256, GgmlDType::Q4_1);
        let wider = quantized(512, GgmlDType::Q4_1);
        let q8 = quantized(256, GgmlDType::Q8_0);
        assert!(stack_rows(&[&first, &wider]).unwrap().is_none());
        assert!(stack_rows(&[&first, &q8]).unwrap().is_none());
        assert!(stack_rows(&[&first]).unwrap().is_none());
    }

    /// On the CPU, parts all in one of our kernels' formats become one matrix of that format whose outputs are each
    /// part's, bit for bit; parts of two formats stay apart.
    #[test]
    fn parts_in_one_of_our_formats_stack_into_one() {
        use super::{Linear, Stacked};
        use candle_core::Device;
        let part = |rows: usize, seed: u64, dtype: GgmlDType| {
            let q = QTensor::quantize(&test_matrix(rows, 256, seed), dtype).unwrap();
            Linear::quantized(Arc::new(q), &Device::Cpu).unwrap()
        };
        let mut formats = vec![
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
        ];
        // The K-quants are ours only where our vector kernels run.
        if super::super::k_quant::Kernel::vector().is_some() {
            formats.extend([GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K]);
        }
        for dtype in formats {
            let parts = vec![part(48, 1, dtype), part(16, 2, dtype), part(16, 3, dtype)];
            let stacked = Stacked::new(parts.clone()).unwrap();
            let Stacked::One(whole, widths) = &stacked else {
                panic!("{dtype:?} parts were not stacked");
            };
            assert!(matches!(
                (whole, dtype),
                (Linear::Q4_0(_), GgmlDType::Q4_0)
                    | (Linear::Q4_1(_), GgmlDType::Q4_1)
                    | (Linear::Q5_0(_), GgmlDType::Q5_0)
                    | (Linear::Q5_1(_), GgmlDType::Q5_1)
                    | (Linear::Q4K(_), GgmlDType::Q4K)
                    | (Linear::Q5K(_), GgmlDType::Q5K)
                    | (Linear::Q6K(_), GgmlDType::Q6K)
            ));
            assert_eq!(widths, &[48, 16, 16]);
            let x = test_matrix(5, 256, 9);
            for (mine, alone) in stacked.forward(&x).unwrap().iter().zip(&parts) {
                let (a, b) = (
                    mine.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    alone
                        .forward(&x)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap(),
                );
                assert_eq!(a, b, "{dtype:?}");
            }
        }
        let mixed = vec![part(16, 1, GgmlDType::Q4_1), part(16, 2, GgmlDType::Q5_0)];
        assert!(matches!(Stacked::new(mixed).unwrap(), Stacked::Many(_)));
    }
}

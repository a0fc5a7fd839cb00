use super::*;
use crate::compute::linear::test_matrix;
use candle_core::quantized::k_quants::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, GgmlType};
use candle_core::quantized::QTensor;
use half::f16;

fn values(t: candle_core::Tensor) -> Vec<f32> {
    t.flatten_all().and_then(|t| t.to_vec1()).expect("values")
}

/// The file's bytes as candle's blocks.
fn blocks_of<B: GgmlType>(bytes: &[u8]) -> Vec<B> {
    let n = bytes.len() / std::mem::size_of::<B>();
    let mut blocks = vec![B::zeros(); n];
    // SAFETY: as above; `blocks` holds exactly `bytes.len()` bytes, every bit pattern of its fields is valid.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            blocks.as_mut_ptr().cast::<u8>(),
            bytes.len(),
        )
    };
    blocks
}

/// Candle's AVX2 product of `x` (`[m, cols]`) by the `[rows, cols]` matrix in `data`, one `vec_dot` per output.
fn candle_dots<B: GgmlType<VecDotType = BlockQ8K>>(
    data: &[u8],
    rows: usize,
    x: &[f32],
    m: usize,
) -> Vec<f32> {
    let cols = x.len() / m;
    let w: Vec<B> = blocks_of(data);
    let nb = cols / QK_K;
    let mut out = vec![];
    for xs in x.chunks_exact(cols) {
        let mut q = vec![BlockQ8K::zeros(); nb];
        BlockQ8K::from_float(xs, &mut q);
        out.extend((0..rows).map(|r| B::vec_dot(cols, &w[r * nb..(r + 1) * nb], &q)));
    }
    out
}

/// A random `[rows, cols]` matrix quantized by candle, as the file's bytes.
fn quantized(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let q = QTensor::quantize(&test_matrix(rows, cols, seed), dtype).expect("quantized");
    q.data().expect("bytes").to_vec()
}

/// Random bytes in every field but the halves, which are set to finite scales: every bit pattern of the packed
/// scales, minimums, nibbles and high bits.
fn random_blocks(layout: BlockLayout, blocks: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    let mut data: Vec<u8> = (0..blocks * layout.bytes)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect();
    for (i, b) in data.chunks_exact_mut(layout.bytes).enumerate() {
        for (h, &at) in layout.halves.iter().enumerate() {
            let v = f16::from_f32(0.001 * (1 + (i + h) % 7) as f32);
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    data
}

fn check_format<F: KFormat, B: GgmlType<VecDotType = BlockQ8K>>() {
    // 37 rows: two full groups and a partial one; activation rows around a tile's and none.
    for cols in [256, 512, 1024] {
        for data in [
            quantized(F::DTYPE, 37, cols, 3),
            random_blocks(F::LAYOUT, 37 * cols / QK_K, cols as u64),
        ] {
            let m = KMatrix::<F>::from_bytes(&data, 37, cols).expect("repacked");
            assert_eq!(m.to_bytes(), data, "{:?}", F::DTYPE);
            for rows in [1, 2, 3, 17] {
                let x = values(test_matrix(rows, cols, rows as u64));
                let want = candle_dots::<B>(&data, 37, &x, rows);
                for kernel in Kernel::available() {
                    let got = m.matmul_with(kernel, &x, rows);
                    assert_eq!(
                        got,
                        want,
                        "{:?}, {kernel:?}, {rows} rows of {cols}",
                        F::DTYPE
                    );
                }
            }
        }
    }
}

#[test]
fn every_kernel_equals_candles_vec_dot_bit_for_bit() {
    check_format::<Q4K, BlockQ4K>();
    check_format::<Q5K, BlockQ5K>();
    check_format::<Q6K, BlockQ6K>();
}

#[test]
fn dequantizes_bit_for_bit_like_candle() {
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let q = QTensor::quantize(&test_matrix(19, 512, 4), dtype).expect("quantized");
        let ours = match dtype {
            GgmlDType::Q4K => Q4KMatrix::from_qtensor(&q).unwrap().unwrap().dequantize(),
            GgmlDType::Q5K => Q5KMatrix::from_qtensor(&q).unwrap().unwrap().dequantize(),
            _ => Q6KMatrix::from_qtensor(&q).unwrap().unwrap().dequantize(),
        };
        crate::compute::linear::assert_dequantizes_like_candle(&q, &ours);
    }
    // Every bit pattern, through candle's own dequantization of the same bytes.
    let data = random_blocks(Q6K::LAYOUT, 4, 5);
    let mut want = vec![0f32; 4 * QK_K];
    BlockQ6K::to_float(&blocks_of::<BlockQ6K>(&data), &mut want);
    assert_eq!(
        Q6KMatrix::from_bytes(&data, 2, 512).unwrap().dequantize(),
        want
    );
    let data = random_blocks(Q4K::LAYOUT, 4, 6);
    BlockQ4K::to_float(&blocks_of::<BlockQ4K>(&data), &mut want);
    assert_eq!(
        Q4KMatrix::from_bytes(&data, 2, 512).unwrap().dequantize(),
        want
    );
}

#[test]
fn repacking_stacks_rows_exactly() {
    let q = QTensor::quantize(&test_matrix(37, 512, 7), GgmlDType::Q4K).unwrap();
    let a = Q4KMatrix::from_qtensor(&q).unwrap().unwrap();
    let b = Q4KMatrix::from_bytes(&quantized(GgmlDType::Q4K, 5, 512, 8), 5, 512).unwrap();
    crate::compute::linear::assert_repacks_and_stacks((&q, &a), &b, Q4KMatrix::matmul);
    // Parts of whole groups: their bytes are copied as they are.
    let q = QTensor::quantize(&test_matrix(32, 512, 11), GgmlDType::Q4K).unwrap();
    let a = Q4KMatrix::from_qtensor(&q).unwrap().unwrap();
    crate::compute::linear::assert_repacks_and_stacks((&q, &a), &b, Q4KMatrix::matmul);
    let q = QTensor::quantize(&test_matrix(37, 256, 9), GgmlDType::Q6K).unwrap();
    let a = Q6KMatrix::from_qtensor(&q).unwrap().unwrap();
    let b = Q6KMatrix::from_bytes(&quantized(GgmlDType::Q6K, 5, 256, 10), 5, 256).unwrap();
    crate::compute::linear::assert_repacks_and_stacks((&q, &a), &b, Q6KMatrix::matmul);
    let q = QTensor::quantize(&test_matrix(16, 256, 12), GgmlDType::Q6K).unwrap();
    let a = Q6KMatrix::from_qtensor(&q).unwrap().unwrap();
    crate::compute::linear::assert_repacks_and_stacks((&q, &a), &b, Q6KMatrix::matmul);
    // Different widths are refused.
    let wide = Q6KMatrix::from_bytes(&quantized(GgmlDType::Q6K, 16, 512, 13), 16, 512).unwrap();
    assert!(Q6KMatrix::concat_rows(&[&a, &wide]).is_err());
}

#[test]
fn as_a_tensor_op_keeps_leading_dims_and_refuses_wrong_sizes() {
    let m = Q4KMatrix::from_bytes(&quantized(GgmlDType::Q4K, 16, 256, 1), 16, 256).unwrap();
    crate::compute::linear::assert_op_shapes(&m, 16, 256);
    let m = Q6KMatrix::from_bytes(&quantized(GgmlDType::Q6K, 16, 256, 1), 16, 256).unwrap();
    crate::compute::linear::assert_op_shapes(&m, 16, 256);
    assert!(Q4KMatrix::from_bytes(&[0; 143], 1, 256).is_err());
    assert!(Q6KMatrix::from_bytes(&[0; 210], 1, 512).is_err());
    // Not a K-quant, or not whole super-blocks: left to candle.
    let q8 = QTensor::quantize(&test_matrix(2, 256, 1), GgmlDType::Q8_0).unwrap();
    assert!(Q4KMatrix::from_qtensor(&q8).unwrap().is_none());
}

//! Candle tensors to and from the wire: little-endian bytes in f32, f16 or bf16 (`petal_proto::pb::Tensor`).
use crate::compute::placement::{normalise, Placement};
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use petal_proto::pb;

/// The wire dtype of a compute dtype; only f32, f16 and bf16 travel.
pub fn wire_dtype(dtype: DType) -> Result<pb::WireDType> {
    match dtype {
        DType::F32 => Ok(pb::WireDType::F32),
        DType::F16 => Ok(pb::WireDType::F16),
        DType::BF16 => Ok(pb::WireDType::Bf16),
        other => Err(ModelError::Config(format!(
            "dtype {other:?} cannot travel on the wire"
        ))),
    }
}

/// The compute dtype of a wire dtype.
pub fn compute_dtype(dtype: pb::WireDType) -> Result<DType> {
    match dtype {
        pb::WireDType::F32 => Ok(DType::F32),
        pb::WireDType::F16 => Ok(DType::F16),
        pb::WireDType::Bf16 => Ok(DType::BF16),
        pb::WireDType::Unspecified => Err(ModelError::Config("unspecified wire dtype".into())),
    }
}

/// `t` as a wire tensor in `dtype` (cast and moved to the CPU as needed).
pub fn to_wire(t: &Tensor, dtype: pb::WireDType) -> Result<pb::Tensor> {
    Ok(pb::Tensor {
        dtype: dtype as i32,
        shape: t.dims().iter().map(|&d| d as u64).collect(),
        data: to_le_bytes(t, compute_dtype(dtype)?)?,
    })
}

/// A CPU tensor from a wire tensor that `petal_proto::tensor::validate` accepted (returning `dtype` and `shape`).
pub fn from_wire(t: &pb::Tensor, dtype: pb::WireDType, shape: &[usize]) -> Result<Tensor> {
    from_le_bytes(&t.data, compute_dtype(dtype)?, shape)
}

/// The elements of `t`, cast to `dtype`, as little-endian bytes in row-major order.
pub fn to_le_bytes(t: &Tensor, dtype: DType) -> Result<Vec<u8>> {
    let t = normalise(t, &Placement::new(Device::Cpu, dtype))?.flatten_all()?;
    Ok(match dtype {
        DType::F32 => le_bytes(&t.to_vec1::<f32>()?, f32::to_le_bytes),
        DType::F16 => le_bytes(&t.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        DType::BF16 => le_bytes(&t.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        other => {
            return Err(ModelError::Config(format!(
                "dtype {other:?} cannot travel on the wire (f32, f16, bf16 can)"
            )))
        }
    })
}

/// `values` as consecutive little-endian bytes, `N` per value (a copy, not a byte-at-a-time iterator).
fn le_bytes<T: Copy, const N: usize>(values: &[T], to_le: fn(T) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * N);
    for &v in values {
        out.extend_from_slice(&to_le(v));
    }
    out
}

/// A CPU tensor from little-endian bytes. The caller has checked that `bytes.len()` matches `shape` and `dtype`
/// (see `petal_proto::tensor::validate`); the tensor is then normalised where it is used.
pub fn from_le_bytes(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let expected = shape.iter().product::<usize>() * dtype.size_in_bytes();
    if bytes.len() != expected {
        return Err(ModelError::Config(format!(
            "{} bytes cannot hold a {dtype:?} tensor of shape {shape:?} ({expected} bytes)",
            bytes.len()
        )));
    }
    // from_raw_buffer reads native-endian; every platform Petal targets is little-endian.
    Ok(Tensor::from_raw_buffer(bytes, dtype, shape, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_each_dtype() {
        let t = Tensor::new(&[[0.5f32, -1.0, 2.0], [3.25, 0.0, -0.125]], &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let bytes = to_le_bytes(&t, dtype).unwrap();
            assert_eq!(bytes.len(), 6 * dtype.size_in_bytes());
            let back = from_le_bytes(&bytes, dtype, &[2, 3]).unwrap();
            assert_eq!(back.dtype(), dtype);
            let back = back.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(back, t.to_vec2::<f32>().unwrap());
        }
        assert!(from_le_bytes(&[0u8; 5], DType::F32, &[2]).is_err());
    }

    #[test]
    fn wire_round_trip() {
        let t = Tensor::new(&[[[1.0f32, 2.0], [3.0, 4.0]]], &Device::Cpu).unwrap();
        let w = to_wire(&t, pb::WireDType::Bf16).unwrap();
        let (dtype, shape) = petal_proto::tensor::validate(&w, 1 << 20).unwrap();
        let back = from_wire(&w, dtype, &shape).unwrap();
        assert_eq!(back.dims(), &[1, 2, 2]);
        assert_eq!(back.dtype(), DType::BF16);
    }
}

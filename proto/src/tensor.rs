//! Tensors on the wire: raw little-endian element bytes plus a shape and a dtype.
//!
//! Everything here treats a [`pb::Tensor`] as untrusted input: [`validate`] checks that shape, dtype and byte
//! length agree (with overflow-checked arithmetic) before anyone interprets the bytes, and [`check_finite`] rejects
//! NaN/Inf so one bad peer cannot poison a whole chain of servers. Conversions go through `f32` so this crate needs
//! no tensor library.

use half::{bf16, f16};

use crate::pb;

/// Why a tensor was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// The dtype field is unspecified or a value this version does not know.
    #[error("unknown or unspecified tensor dtype {0}")]
    UnknownDType(i32),
    /// The data does not hold exactly shape x element size bytes.
    #[error("tensor data is {actual} bytes, expected {expected}")]
    ByteLength { expected: usize, actual: usize },
    /// The shape is empty, has a zero dimension, or its size overflows.
    #[error("bad tensor shape: {reason}")]
    Shape { reason: String },
    /// More elements than the receiver accepts.
    #[error("tensor has {elements} elements, limit is {max}")]
    TooManyElements { elements: usize, max: usize },
    /// Element `index` (in row-major order) is NaN or infinite.
    #[error("non-finite value at element {index}")]
    NonFinite { index: usize },
}

impl TensorError {
    /// The error code a server answers this failure with.
    pub fn error_code(&self) -> pb::ErrorCode {
        match self {
            TensorError::UnknownDType(_) | TensorError::ByteLength { .. } => {
                pb::ErrorCode::DtypeMismatch
            }
            TensorError::Shape { .. } | TensorError::TooManyElements { .. } => {
                pb::ErrorCode::ShapeMismatch
            }
            TensorError::NonFinite { .. } => pb::ErrorCode::NonFinite,
        }
    }
}

impl pb::WireDType {
    /// Bytes per element; `None` for `Unspecified`, which no tensor may carry.
    pub fn element_size(self) -> Option<usize> {
        match self {
            pb::WireDType::Unspecified => None,
            pb::WireDType::F32 => Some(4),
            pb::WireDType::F16 | pb::WireDType::Bf16 => Some(2),
        }
    }

    /// Short lowercase name ("f32", "f16", "bf16", "unspecified"), the inverse of [`parse_dtype`].
    pub fn name(self) -> &'static str {
        match self {
            pb::WireDType::Unspecified => "unspecified",
            pb::WireDType::F32 => "f32",
            pb::WireDType::F16 => "f16",
            pb::WireDType::Bf16 => "bf16",
        }
    }
}

/// Room in a frame for everything but a step's hidden states (the request's other fields, protobuf tags).
const FRAME_HEADROOM_BYTES: usize = 64 * 1024;

/// How many tokens of `batch` x `hidden` states in `dtype` one frame of at most `max_frame_bytes` can carry (at
/// least 1): what both sides split a long step by, so that no step is refused for its size on the wire.
pub fn tokens_per_frame(
    max_frame_bytes: usize,
    batch: usize,
    hidden: usize,
    dtype: pb::WireDType,
) -> usize {
    let per_token = batch.max(1) * hidden.max(1) * dtype.element_size().unwrap_or(4);
    (max_frame_bytes.saturating_sub(FRAME_HEADROOM_BYTES) / per_token).max(1)
}

/// Parses "f32", "f16" or "bf16" (ASCII case-insensitive), e.g. from a command-line flag.
pub fn parse_dtype(s: &str) -> Option<pb::WireDType> {
    [pb::WireDType::F32, pb::WireDType::F16, pb::WireDType::Bf16]
        .into_iter()
        .find(|d| d.name().eq_ignore_ascii_case(s))
}

/// The known, specified dtype of a raw dtype field.
fn known_dtype(raw: i32) -> Result<(pb::WireDType, usize), TensorError> {
    let dtype = pb::WireDType::try_from(raw).map_err(|_| TensorError::UnknownDType(raw))?;
    let size = dtype.element_size().ok_or(TensorError::UnknownDType(raw))?;
    Ok((dtype, size))
}

/// Checks an untrusted tensor and returns its dtype and shape.
///
/// The dtype must be known and specified, the shape non-empty with every dimension > 0, the element count at most
/// `max_elements` (computed with checked arithmetic: overflow is a `Shape` error), and `data` exactly
/// elements x element size bytes. Values are not inspected; see [`check_finite`].
pub fn validate(
    t: &pb::Tensor,
    max_elements: usize,
) -> Result<(pb::WireDType, Vec<usize>), TensorError> {
    let (dtype, size) = known_dtype(t.dtype)?;
    if t.shape.is_empty() {
        return Err(TensorError::Shape {
            reason: "shape is empty".into(),
        });
    }
    let mut shape = Vec::with_capacity(t.shape.len());
    let mut elements: usize = 1;
    for (axis, &dim) in t.shape.iter().enumerate() {
        if dim == 0 {
            return Err(TensorError::Shape {
                reason: format!("dimension {axis} is zero"),
            });
        }
        let dim = usize::try_from(dim).map_err(|_| TensorError::Shape {
            reason: format!("dimension {axis} ({dim}) does not fit in memory"),
        })?;
        elements = elements
            .checked_mul(dim)
            .ok_or_else(|| TensorError::Shape {
                reason: format!("element count overflows at dimension {axis}"),
            })?;
        shape.push(dim);
    }
    if elements > max_elements {
        return Err(TensorError::TooManyElements {
            elements,
            max: max_elements,
        });
    }
    let expected = elements
        .checked_mul(size)
        .ok_or_else(|| TensorError::Shape {
            reason: "byte length overflows".into(),
        })?;
    if t.data.len() != expected {
        return Err(TensorError::ByteLength {
            expected,
            actual: t.data.len(),
        });
    }
    Ok((dtype, shape))
}

/// Returns `NonFinite` with the index of the first NaN or infinity in `data` (little-endian elements of `dtype`).
///
/// `UnknownDType` for `Unspecified`; `ByteLength` when `data` is not a whole number of elements.
pub fn check_finite(dtype: pb::WireDType, data: &[u8]) -> Result<(), TensorError> {
    let size = dtype
        .element_size()
        .ok_or(TensorError::UnknownDType(dtype as i32))?;
    check_whole_elements(data, size)?;
    let first_bad = match dtype {
        pb::WireDType::F32 => data
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
        pb::WireDType::F16 => data
            .chunks_exact(2)
            .position(|c| !f16::from_le_bytes([c[0], c[1]]).is_finite()),
        pb::WireDType::Bf16 => data
            .chunks_exact(2)
            .position(|c| !bf16::from_le_bytes([c[0], c[1]]).is_finite()),
        pb::WireDType::Unspecified => None,
    };
    match first_bad {
        Some(index) => Err(TensorError::NonFinite { index }),
        None => Ok(()),
    }
}

fn check_whole_elements(data: &[u8], size: usize) -> Result<(), TensorError> {
    let rem = data.len() % size;
    if rem != 0 {
        return Err(TensorError::ByteLength {
            expected: data.len() - rem,
            actual: data.len(),
        });
    }
    Ok(())
}

/// Encodes `values` as little-endian bytes of `dtype`, rounding to nearest for f16/bf16.
///
/// `Unspecified` is encoded as f32 (there is nothing better to do); such a tensor is refused by [`validate`].
pub fn encode_values(values: &[f32], dtype: pb::WireDType) -> Vec<u8> {
    match dtype {
        pb::WireDType::F32 | pb::WireDType::Unspecified => {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        pb::WireDType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        pb::WireDType::Bf16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// Decodes little-endian elements of `dtype` to `f32` (exact for every dtype: f16 and bf16 widen losslessly).
pub fn decode_values(dtype: pb::WireDType, data: &[u8]) -> Result<Vec<f32>, TensorError> {
    let size = dtype
        .element_size()
        .ok_or(TensorError::UnknownDType(dtype as i32))?;
    check_whole_elements(data, size)?;
    Ok(match dtype {
        pb::WireDType::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        pb::WireDType::F16 => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        pb::WireDType::Bf16 => data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        pb::WireDType::Unspecified => Vec::new(),
    })
}

/// Builds a tensor from `f32` values, converting them to `dtype`.
///
/// Does not check that `values.len()` matches `shape`; [`validate`] on the receiving side does.
pub fn from_f32(values: &[f32], shape: &[usize], dtype: pb::WireDType) -> pb::Tensor {
    pb::Tensor {
        dtype: dtype as i32,
        shape: shape.iter().map(|&d| d as u64).collect(),
        data: encode_values(values, dtype),
    }
}

/// Validates `t` (with no element limit) and returns its values as `f32`, in row-major order.
///
/// NaN and infinities are returned as they are; call [`check_finite`] to refuse them.
pub fn to_f32(t: &pb::Tensor) -> Result<Vec<f32>, TensorError> {
    let (dtype, _shape) = validate(t, usize::MAX)?;
    decode_values(dtype, &t.data)
}

#[cfg(test)]
mod tests;

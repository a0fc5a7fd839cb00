//! The bytes of a GGUF file's header: magic, counts, metadata values, tensor descriptions with their offsets.
use super::gguf::{pad, GgufTensor, ALIGNMENT};
use crate::compute::linear::mxfp4;
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use std::io::{self, Seek, Write};

/// GGUF v3: magic, counts, the metadata, the tensor descriptions with their data offsets, padding.
pub(super) fn write_header<W: Write + Seek>(
    out: &mut W,
    metadata: &[(String, Value)],
    tensors: &[GgufTensor],
) -> io::Result<()> {
    out.write_all(b"GGUF")?;
    out.write_all(&3u32.to_le_bytes())?;
    out.write_all(&(tensors.len() as u64).to_le_bytes())?;
    out.write_all(&(metadata.len() as u64).to_le_bytes())?;
    for (key, value) in metadata {
        write_string(out, key)?;
        out.write_all(&value_type(value)?.to_le_bytes())?;
        write_value(out, value)?;
    }
    let mut offset = 0u64;
    for t in tensors {
        write_string(out, &t.name)?;
        out.write_all(&(t.dims.len() as u32).to_le_bytes())?;
        for &d in &t.dims {
            out.write_all(&(d as u64).to_le_bytes())?;
        }
        out.write_all(&t.dtype.id().to_le_bytes())?;
        out.write_all(&offset.to_le_bytes())?;
        offset += (t.bytes() as u64).div_ceil(ALIGNMENT) * ALIGNMENT;
    }
    pad(out)
}

/// A tensor's type in the file: one of candle's, or MXFP4 (ggml's type 39), which candle does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TensorType {
    Ggml(GgmlDType),
    Mxfp4,
}

impl TensorType {
    pub(super) const F32: Self = Self::Ggml(GgmlDType::F32);

    /// Values per block.
    pub(super) fn block_size(self) -> usize {
        match self {
            Self::Ggml(d) => d.block_size(),
            Self::Mxfp4 => mxfp4::QK_MXFP4,
        }
    }

    /// Bytes per block.
    pub(super) fn type_size(self) -> usize {
        match self {
            Self::Ggml(d) => d.type_size(),
            Self::Mxfp4 => mxfp4::BLOCK_BYTES,
        }
    }

    /// ggml's `ggml_type` number.
    fn id(self) -> u32 {
        match self {
            Self::Ggml(GgmlDType::F32) => 0,
            Self::Ggml(GgmlDType::Q4_0) => 2,
            Self::Ggml(GgmlDType::Q8_0) => 8,
            Self::Ggml(GgmlDType::Q4K) => 12,
            Self::Ggml(GgmlDType::Q5K) => 13,
            Self::Ggml(GgmlDType::Q6K) => 14,
            Self::Mxfp4 => 39,
            Self::Ggml(other) => unreachable!("synthetic GGUF files hold no {other:?}"),
        }
    }
}

fn write_string(out: &mut impl Write, s: &str) -> io::Result<()> {
    out.write_all(&(s.len() as u64).to_le_bytes())?;
    out.write_all(s.as_bytes())
}

/// GGUF's code for the type of `v` (an array's elements must share one).
fn value_type(v: &Value) -> io::Result<u32> {
    Ok(match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    })
}

fn write_value(out: &mut impl Write, v: &Value) -> io::Result<()> {
    match v {
        Value::U8(x) => out.write_all(&[*x]),
        Value::I8(x) => out.write_all(&x.to_le_bytes()),
        Value::U16(x) => out.write_all(&x.to_le_bytes()),
        Value::I16(x) => out.write_all(&x.to_le_bytes()),
        Value::U32(x) => out.write_all(&x.to_le_bytes()),
        Value::I32(x) => out.write_all(&x.to_le_bytes()),
        Value::U64(x) => out.write_all(&x.to_le_bytes()),
        Value::I64(x) => out.write_all(&x.to_le_bytes()),
        Value::F32(x) => out.write_all(&x.to_le_bytes()),
        Value::F64(x) => out.write_all(&x.to_le_bytes()),
        Value::Bool(x) => out.write_all(&[u8::from(*x)]),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            let kind = match items.first() {
                Some(first) => value_type(first)?,
                None => 4,
            };
            out.write_all(&kind.to_le_bytes())?;
            out.write_all(&(items.len() as u64).to_le_bytes())?;
            for item in items {
                if value_type(item)? != kind {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a GGUF array mixes value types",
                    ));
                }
                write_value(out, item)?;
            }
            Ok(())
        }
    }
}

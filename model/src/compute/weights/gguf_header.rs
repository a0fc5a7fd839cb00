//! A GGUF header reader that takes tensors of types candle does not know: candle 0.11.1's `Content::read` fails on
//! the whole file when one tensor has a type outside its `GgmlDType` (gpt-oss's experts are MXFP4, ggml's type
//! 39), so a file that is mostly Q8_0 and F32 could not be opened at all.
//!
//! [`read_header`] parses what candle parses (GGUF v1 to v3: the metadata with every value type, nested arrays
//! included, the tensor index, the alignment and where the data starts) into candle's own [`Content`], equal to
//! candle's parse for any file candle reads, with candle's limits on counts, lengths and nesting; the tensors of
//! the types candle lacks that we have kernels for go beside it as [`RawTensorInfo`]s, and any other type is an
//! error that names the tensor.
//!
//! It also reads the header with fewer system calls than candle's parser behind a `BufReader`: candle asks the
//! reader for its position before every string and array (to check lengths against the bytes left), and a
//! `BufReader<File>` answers that with an `lseek`, some 100 000 for a vocabulary of 49 152 tokens and as many
//! merges. Here the position is counted as bytes are read, and the file's length taken once.
// Nothing outside the tests calls it until weights/gguf.rs reads its headers through here.

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};

/// ggml's type number for MXFP4 blocks (`GGML_TYPE_MXFP4`).
pub(crate) const GGML_TYPE_MXFP4: u32 = 39;

/// The alignment of the tensor data when the file does not say (`general.alignment`).
const DEFAULT_ALIGNMENT: u64 = 32;
// candle's limits (after llama.cpp's GGUF_MAX_STRING_LENGTH, GGUF_MAX_ARRAY_ELEMENTS and GGML_MAX_DIMS), so a file
// candle refuses as corrupt is refused here too; the depth bounds the recursion through nested arrays.
const MAX_STRING_LENGTH: u64 = 1 << 30;
const MAX_ARRAY_ELEMENTS: u64 = 1 << 30;
const MAX_TENSOR_DIMS: u32 = 4;
const MAX_VALUE_DEPTH: usize = 64;

/// A tensor of a type candle has no `GgmlDType` for: where its data is and how to read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawTensorInfo {
    /// Candle's order: the file's dimensions reversed, the rows' length last.
    pub dims: Vec<usize>,
    /// From the start of the tensor data ([`Content::tensor_data_offset`]), as candle's `TensorInfo::offset`.
    pub offset: u64,
    /// The ggml type number ([`GGML_TYPE_MXFP4`]).
    pub dtype: u32,
}

impl RawTensorInfo {
    /// Bytes of the tensor's data (MXFP4: 17 per 32 values), or `None` when its values are not whole blocks or
    /// the count overflows.
    pub fn byte_len(&self) -> Option<u64> {
        let (per_block, block_bytes) = match self.dtype {
            GGML_TYPE_MXFP4 => (32u64, 17u64),
            _ => return None,
        };
        let elems = self
            .dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?))?;
        (elems % per_block == 0)
            .then(|| (elems / per_block).checked_mul(block_bytes))
            .flatten()
    }
}

/// The header of the GGUF file `reader` is at the start of: candle's [`Content`] of every tensor of a type candle
/// knows, and the MXFP4 tensors by name. Later entries of a name replace earlier ones, as in candle.
///
/// `reader` should be buffered (a `BufReader<File>`): every field is a `read_exact` of its own, a system call
/// each on a bare `File`. Its position afterwards is the end of the tensor index (the data starts at
/// `tensor_data_offset`, past the alignment's padding).
pub(crate) fn read_header<R: Read + Seek>(
    reader: &mut R,
) -> candle_core::Result<(Content, BTreeMap<String, RawTensorInfo>)> {
    let start = reader.stream_position()?;
    let end = reader.seek(SeekFrom::End(0))?;
    reader.seek(SeekFrom::Start(start))?;
    let mut h = Header {
        reader,
        pos: start,
        end,
        magic: VersionedMagic::GgufV3,
    };
    h.magic = match (h.u32()?, h.u32()?) {
        (0x4655_4747 | 0x4747_5546, 1) => VersionedMagic::GgufV1,
        (0x4655_4747 | 0x4747_5546, 2) => VersionedMagic::GgufV2,
        (0x4655_4747 | 0x4747_5546, 3) => VersionedMagic::GgufV3,
        (0x4655_4747 | 0x4747_5546, v) => candle_core::bail!("gguf: unsupported version {v}"),
        (magic, _) => candle_core::bail!("gguf: unknown magic 0x{magic:08x}"),
    };
    let tensor_count = h.length()?;
    let kv_count = h.length()?;
    if tensor_count > MAX_ARRAY_ELEMENTS || kv_count > MAX_ARRAY_ELEMENTS {
        candle_core::bail!("gguf: {tensor_count} tensors and {kv_count} metadata entries exceed the limit {MAX_ARRAY_ELEMENTS}")
    }
    // Each entry's smallest size on disk (a key, a type and a byte; a name, a dimension count, a type and an
    // offset): counts the file cannot hold are refused before anything is allocated for them.
    let prefix = h.length_size();
    let needed = kv_count
        .saturating_mul(prefix + 4 + 1)
        .saturating_add(tensor_count.saturating_mul(prefix + 4 + 4 + 8));
    if needed > h.remaining() {
        candle_core::bail!(
            "gguf: {tensor_count} tensors and {kv_count} metadata entries need at least {needed} bytes, only {} remain",
            h.remaining()
        )
    }

    let mut metadata = HashMap::new();
    for _ in 0..kv_count {
        let key = h.string()?;
        let ty = h.u32()?;
        let value = h.value(ty, 0)?;
        metadata.insert(key, value);
    }
    let mut tensor_infos = HashMap::new();
    let mut raw = BTreeMap::new();
    for _ in 0..tensor_count {
        let name = h.string()?;
        let n_dims = h.u32()?;
        if n_dims > MAX_TENSOR_DIMS {
            candle_core::bail!("gguf: tensor {name:?} has {n_dims} dimensions, at most {MAX_TENSOR_DIMS} are allowed")
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = match h.magic {
                VersionedMagic::GgufV1 => u64::from(h.u32()?),
                VersionedMagic::GgufV2 | VersionedMagic::GgufV3 => h.u64()?,
            };
            match usize::try_from(d) {
                Ok(d) => dims.push(d),
                Err(_) => candle_core::bail!("gguf: tensor {name:?} has a dimension of {d}"),
            }
        }
        dims.reverse();
        let dtype = h.u32()?;
        let offset = h.u64()?;
        if let Some(ggml_dtype) = candle_dtype(dtype) {
            raw.remove(&name);
            let shape = candle_core::Shape::from(dims);
            let info = TensorInfo {
                ggml_dtype,
                shape,
                offset,
            };
            tensor_infos.insert(name, info);
        } else if dtype == GGML_TYPE_MXFP4 {
            tensor_infos.remove(&name);
            raw.insert(
                name,
                RawTensorInfo {
                    dims,
                    offset,
                    dtype,
                },
            );
        } else {
            candle_core::bail!(
                "gguf: tensor {name:?} has ggml type {dtype}, which neither candle nor we read"
            )
        }
    }
    // Candle's reading of the alignment: any integer type up to 32 bits, else the default.
    let alignment = match metadata.get("general.alignment") {
        Some(Value::U8(v)) => u64::from(*v),
        Some(Value::U16(v)) => u64::from(*v),
        Some(Value::U32(v)) => u64::from(*v),
        Some(Value::I8(v)) if *v >= 0 => *v as u64,
        Some(Value::I16(v)) if *v >= 0 => *v as u64,
        Some(Value::I32(v)) if *v >= 0 => *v as u64,
        _ => DEFAULT_ALIGNMENT,
    };
    if alignment == 0 {
        // Candle divides by it.
        candle_core::bail!("gguf: general.alignment is 0")
    }
    let tensor_data_offset = h.pos.div_ceil(alignment) * alignment;
    let content = Content {
        magic: h.magic,
        metadata,
        tensor_infos,
        tensor_data_offset,
    };
    Ok((content, raw))
}

/// Candle's `GgmlDType` for a ggml type number (candle's own mapping is private to it).
fn candle_dtype(t: u32) -> Option<GgmlDType> {
    Some(match t {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The reader, the position it is at (counted, not asked for) and the file's end.
struct Header<'a, R> {
    reader: &'a mut R,
    pos: u64,
    end: u64,
    magic: VersionedMagic,
}

impl<R: Read> Header<'_, R> {
    fn bytes<const N: usize>(&mut self) -> candle_core::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.reader.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> candle_core::Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> candle_core::Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    fn remaining(&self) -> u64 {
        self.end.saturating_sub(self.pos)
    }

    /// Bytes of a string's or an array's length: 4 in GGUF v1, 8 after.
    fn length_size(&self) -> u64 {
        match self.magic {
            VersionedMagic::GgufV1 => 4,
            VersionedMagic::GgufV2 | VersionedMagic::GgufV3 => 8,
        }
    }

    fn length(&mut self) -> candle_core::Result<u64> {
        match self.magic {
            VersionedMagic::GgufV1 => Ok(u64::from(self.u32()?)),
            VersionedMagic::GgufV2 | VersionedMagic::GgufV3 => self.u64(),
        }
    }

    /// A length-prefixed string, as candle reads it: trailing NULs dropped (files have them, though the format
    /// says not), invalid UTF-8 replaced.
    fn string(&mut self) -> candle_core::Result<String> {
        let len = self.length()?;
        if len > MAX_STRING_LENGTH || len > self.remaining() {
            candle_core::bail!(
                "gguf: a string of {len} bytes, with {} left in the file (at most {MAX_STRING_LENGTH})",
                self.remaining()
            )
        }
        let mut v = vec![0u8; len as usize];
        self.reader.read_exact(&mut v)?;
        self.pos += len;
        while v.last() == Some(&0) {
            v.pop();
        }
        Ok(match String::from_utf8(v) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// A value of GGUF type `ty`, `depth` arrays deep.
    fn value(&mut self, ty: u32, depth: usize) -> candle_core::Result<Value> {
        if depth > MAX_VALUE_DEPTH {
            candle_core::bail!("gguf: arrays nested deeper than {MAX_VALUE_DEPTH}")
        }
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()? {
                [0] => Value::Bool(false),
                [1] => Value::Bool(true),
                [b] => candle_core::bail!("gguf: a bool of {b}"),
            },
            8 => Value::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                let len = self.length()?;
                let Some(min) = self.min_size(elem) else {
                    candle_core::bail!("gguf: an array of unknown value type {elem}")
                };
                let needed = len.saturating_mul(min);
                if len > MAX_ARRAY_ELEMENTS || needed > self.remaining() {
                    candle_core::bail!(
                        "gguf: an array of {len} elements (at least {needed} bytes) with {} left in the file",
                        self.remaining()
                    )
                }
                let mut vs = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    vs.push(self.value(elem, depth + 1)?);
                }
                Value::Array(vs)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            t => candle_core::bail!("gguf: unknown value type {t}"),
        })
    }

    /// The fewest bytes a value of type `ty` takes on disk; `None` for no type.
    fn min_size(&self, ty: u32) -> Option<u64> {
        Some(match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => self.length_size(),
            9 => 4 + self.length_size(),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::linear::mxfp4::{quantize_ggml, Mxfp4Matrix};
    use crate::compute::linear::test_matrix;
    use candle_core::quantized::{gguf_file, QTensor};
    use std::io::{BufReader, Cursor};

    /// Two values equal variant for variant, floats bit for bit (candle's `Value` has no `PartialEq`).
    fn same_value(a: &Value, b: &Value) -> bool {
        match (a, b) {
            (Value::U8(a), Value::U8(b)) => a == b,
            (Value::I8(a), Value::I8(b)) => a == b,
            (Value::U16(a), Value::U16(b)) => a == b,
            (Value::I16(a), Value::I16(b)) => a == b,
            (Value::U32(a), Value::U32(b)) => a == b,
            (Value::I32(a), Value::I32(b)) => a == b,
            (Value::U64(a), Value::U64(b)) => a == b,
            (Value::I64(a), Value::I64(b)) => a == b,
            (Value::F32(a), Value::F32(b)) => a.to_bits() == b.to_bits(),
            (Value::F64(a), Value::F64(b)) => a.to_bits() == b.to_bits(),
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::String(a), Value::String(b)) => a == b,
            (Value::Array(a), Value::Array(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_value(a, b))
            }
            _ => false,
        }
    }

    /// `ours` is candle's parse, field by field.
    fn assert_same_content(ours: &Content, candle: &Content) {
        assert_eq!(ours.magic, candle.magic);
        assert_eq!(ours.tensor_data_offset, candle.tensor_data_offset);
        assert_eq!(ours.metadata.len(), candle.metadata.len());
        for (k, v) in &candle.metadata {
            let mine = ours
                .metadata
                .get(k)
                .unwrap_or_else(|| panic!("{k} missing"));
            assert!(same_value(mine, v), "{k}: {mine:?} against {v:?}");
        }
        assert_eq!(ours.tensor_infos.len(), candle.tensor_infos.len());
        for (name, t) in &candle.tensor_infos {
            let mine = &ours.tensor_infos[name];
            assert_eq!(
                (mine.ggml_dtype, mine.shape.dims(), mine.offset),
                (t.ggml_dtype, t.shape.dims(), t.offset),
                "{name}"
            );
        }
    }

    /// Metadata of every value type, arrays of arrays and an empty one among them.
    fn every_value() -> Vec<(&'static str, Value)> {
        vec![
            ("u8", Value::U8(200)),
            ("i8", Value::I8(-100)),
            ("u16", Value::U16(60000)),
            ("i16", Value::I16(-30000)),
            ("u32", Value::U32(4_000_000_000)),
            ("i32", Value::I32(-2_000_000_000)),
            ("u64", Value::U64(u64::MAX - 1)),
            ("i64", Value::I64(i64::MIN + 1)),
            ("f32", Value::F32(-1.5e-3)),
            ("f64", Value::F64(std::f64::consts::PI)),
            ("bool", Value::Bool(true)),
            ("string", Value::String("héllo".into())),
            (
                "tokens",
                Value::Array(vec![Value::String("a".into()), Value::String("".into())]),
            ),
            (
                "nested",
                Value::Array(vec![
                    Value::Array(vec![Value::I32(1), Value::I32(-2)]),
                    Value::Array(vec![]),
                ]),
            ),
            // What candle's writer pads to: the data is where the header says.
            ("general.alignment", Value::U32(32)),
        ]
    }

    /// A GGUF written by candle: F32, Q8_0 and Q4_0 tensors and [`every_value`].
    fn candle_file() -> Vec<u8> {
        let q =
            |rows, dtype| QTensor::quantize(&test_matrix(rows, 64, rows as u64), dtype).unwrap();
        let tensors = [
            ("token_embd.weight", q(3, GgmlDType::F32)),
            ("blk.0.attn_q.weight", q(4, GgmlDType::Q8_0)),
            ("blk.0.ffn_gate_exps.weight", q(2, GgmlDType::Q4_0)),
        ];
        let values = every_value();
        let metadata: Vec<(&str, &Value)> = values.iter().map(|(k, v)| (*k, v)).collect();
        let named: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        let mut file = Cursor::new(vec![]);
        gguf_file::write(&mut file, &metadata, &named).unwrap();
        file.into_inner()
    }

    /// Where in `file` the type of tensor `name` (of `n_dims` dimensions, GGUF v2 or v3) is written.
    fn type_field(file: &[u8], name: &str, n_dims: usize) -> usize {
        let mut key = (name.len() as u64).to_le_bytes().to_vec();
        key.extend(name.as_bytes());
        let at = file
            .windows(key.len())
            .position(|w| w == key)
            .expect("the tensor's name");
        at + key.len() + 4 + 8 * n_dims
    }

    #[test]
    fn a_file_candle_reads_gives_candles_content() {
        let file = candle_file();
        let (ours, raw) = read_header(&mut Cursor::new(&file)).unwrap();
        let candle = Content::read(&mut Cursor::new(&file)).unwrap();
        assert!(raw.is_empty());
        assert_same_content(&ours, &candle);
        assert_eq!(ours.tensor_data_offset % 32, 0);
        // Version 3 lays its header out as version 2 does.
        let mut v3 = file.clone();
        v3[4..8].copy_from_slice(&3u32.to_le_bytes());
        let (ours, _) = read_header(&mut Cursor::new(&v3)).unwrap();
        assert_same_content(&ours, &Content::read(&mut Cursor::new(&v3)).unwrap());
        assert_eq!(ours.magic, VersionedMagic::GgufV3);
    }

    #[test]
    fn an_mxfp4_tensor_goes_beside_candles_content_and_its_bytes_read_back() {
        // The Q4_0 tensor ([2, 64]: 72 bytes, 96 with padding) retyped as MXFP4 (68 bytes) and its data replaced.
        let mut file = candle_file();
        let name = "blk.0.ffn_gate_exps.weight";
        let at = type_field(&file, name, 2);
        assert_eq!(file[at..at + 4], 2u32.to_le_bytes());
        file[at..at + 4].copy_from_slice(&GGML_TYPE_MXFP4.to_le_bytes());
        assert!(
            Content::read(&mut Cursor::new(&file)).is_err(),
            "candle refuses the whole file"
        );
        let (ours, raw) = read_header(&mut Cursor::new(&file)).unwrap();
        let info = &raw[name];
        assert_eq!((info.dims.as_slice(), info.dtype), (&[2, 64][..], 39));
        assert_eq!(info.byte_len(), Some(68));
        assert!(!ours.tensor_infos.contains_key(name));
        assert_eq!(ours.tensor_infos.len(), 2);
        // Representable at the exponent a block whose largest magnitude is 6 gets: every value comes back.
        let values: Vec<f32> = (0..128)
            .map(|i| [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, -1.0, -2.0, -3.0, -4.0, -6.0][i % 11])
            .collect();
        let start = (ours.tensor_data_offset + info.offset) as usize;
        file[start..start + 68].copy_from_slice(&quantize_ggml(&values, 64));
        let m = Mxfp4Matrix::from_ggml_bytes(&file[start..start + 68], 2, 64).unwrap();
        assert_eq!(m.dequantize(), values);
        // The other tensors are candle's, read where candle would read them.
        let before = candle_file();
        let candle = Content::read(&mut Cursor::new(&before)).unwrap();
        for (n, t) in &ours.tensor_infos {
            let (a, b) = (
                t.read(
                    &mut Cursor::new(&file),
                    ours.tensor_data_offset,
                    &candle_core::Device::Cpu,
                ),
                candle.tensor(&mut Cursor::new(&before), n, &candle_core::Device::Cpu),
            );
            assert_eq!(
                a.unwrap().data().unwrap(),
                b.unwrap().data().unwrap(),
                "{n}"
            );
        }
        // Any other type candle lacks is an error naming the tensor and the type.
        file[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
        let err = read_header(&mut Cursor::new(&file))
            .unwrap_err()
            .to_string();
        assert!(err.contains(name) && err.contains("99"), "{err}");
    }

    /// A GGUF v1 header (32-bit lengths and dimensions) by hand: `general.alignment` as an `i8`, an array of
    /// arrays of strings, one F32 tensor and one MXFP4, then their data.
    fn v1_file() -> Vec<u8> {
        let mut f = vec![];
        let string = |f: &mut Vec<u8>, s: &str| {
            f.extend((s.len() as u32).to_le_bytes());
            f.extend(s.as_bytes());
        };
        f.extend(b"GGUF");
        f.extend(1u32.to_le_bytes());
        f.extend(2u32.to_le_bytes()); // tensors
        f.extend(2u32.to_le_bytes()); // metadata
        string(&mut f, "general.alignment");
        f.extend(1u32.to_le_bytes());
        f.push(16);
        string(&mut f, "words");
        f.extend(9u32.to_le_bytes());
        f.extend(9u32.to_le_bytes());
        f.extend(2u32.to_le_bytes());
        for words in [&["ab", "c\0"][..], &[]] {
            f.extend(8u32.to_le_bytes());
            f.extend((words.len() as u32).to_le_bytes());
            for w in words {
                string(&mut f, w);
            }
        }
        for (name, dims, dtype, offset) in
            [("norm", [32u32, 1], 0u32, 0u64), ("exps", [64, 3], 39, 128)]
        {
            string(&mut f, name);
            f.extend(2u32.to_le_bytes());
            for d in dims {
                f.extend(d.to_le_bytes());
            }
            f.extend(dtype.to_le_bytes());
            f.extend(offset.to_le_bytes());
        }
        f.resize(f.len().div_ceil(16) * 16 + 128 + 102, 0);
        f
    }

    #[test]
    fn a_version_1_header_reads_as_candle_reads_it() {
        let file = v1_file();
        let (ours, raw) = read_header(&mut Cursor::new(&file)).unwrap();
        let mut without = file.clone();
        let at = without.windows(4).position(|w| w == b"exps").unwrap() + 4 + 4 + 8;
        without[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
        let candle = Content::read(&mut Cursor::new(&without)).unwrap();
        assert_eq!(ours.magic, VersionedMagic::GgufV1);
        assert_eq!(ours.tensor_data_offset % 16, 0);
        assert_eq!(ours.tensor_data_offset, candle.tensor_data_offset);
        assert_eq!(ours.metadata.len(), 2);
        for (k, v) in &candle.metadata {
            assert!(same_value(&ours.metadata[k], v), "{k}");
        }
        assert!(same_value(
            &ours.metadata["words"],
            &Value::Array(vec![
                Value::Array(vec![Value::String("ab".into()), Value::String("c".into())]),
                Value::Array(vec![]),
            ])
        ));
        assert_eq!(ours.tensor_infos["norm"].shape.dims(), &[1, 32]);
        assert_eq!(
            raw["exps"],
            RawTensorInfo {
                dims: vec![3, 64],
                offset: 128,
                dtype: 39
            }
        );
        assert_eq!(raw["exps"].byte_len(), Some(102));
    }

    #[test]
    fn corrupt_headers_are_errors_not_panics() {
        let file = candle_file();
        // Cut anywhere inside the header.
        let end = type_field(&file, "blk.0.ffn_gate_exps.weight", 2) + 12;
        for cut in (0..end).step_by(7) {
            assert!(
                read_header(&mut Cursor::new(&file[..cut])).is_err(),
                "cut at {cut}"
            );
        }
        let mut bad = file.clone();
        bad[..4].copy_from_slice(b"GGML");
        assert!(read_header(&mut Cursor::new(&bad)).is_err());
        let mut bad = file.clone();
        bad[4..8].copy_from_slice(&4u32.to_le_bytes());
        assert!(read_header(&mut Cursor::new(&bad)).is_err());
        // A tensor count the file cannot hold.
        let mut bad = file.clone();
        bad[8..16].copy_from_slice(&(1u64 << 29).to_le_bytes());
        assert!(read_header(&mut Cursor::new(&bad)).is_err());
        // An alignment of zero (candle would divide by it).
        let mut zero = v1_file();
        let at = zero
            .windows(17)
            .position(|w| w == b"general.alignment")
            .unwrap()
            + 17
            + 4;
        zero[at] = 0;
        assert!(read_header(&mut Cursor::new(&zero)).is_err());
    }

    /// A reader that counts the reads and seeks that reach it.
    struct Counting<R> {
        inner: R,
        reads: usize,
        seeks: usize,
    }

    impl<R: Read> Read for Counting<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.reads += 1;
            self.inner.read(buf)
        }
    }

    impl<R: Seek> Seek for Counting<R> {
        fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
            self.seeks += 1;
            self.inner.seek(pos)
        }
    }

    #[test]
    fn smollm2s_header_is_candles_and_takes_a_read_per_buffer() {
        let relative = crate::models_dir::DEFAULT_MODEL;
        let path = crate::models_dir::find_model(relative)
            .unwrap_or_else(|| panic!("{}", crate::models_dir::missing_model(relative)));
        let open = || std::fs::File::open(&path).expect("the model file");
        let candle = Content::read(&mut BufReader::new(open())).unwrap();
        let mut counted = BufReader::new(Counting {
            inner: open(),
            reads: 0,
            seeks: 0,
        });
        let (ours, raw) = read_header(&mut counted).unwrap();
        assert!(raw.is_empty());
        assert_same_content(&ours, &candle);
        let (reads, seeks) = (counted.get_ref().reads, counted.get_ref().seeks);
        // A read per 8 KiB buffer of a header of some 2 MB, and the three seeks that find the file's length.
        let buffers = (ours.tensor_data_offset as usize).div_ceil(8192);
        assert!(reads <= buffers + 4, "{reads} reads for {buffers} buffers");
        assert!(seeks <= 3, "{seeks} seeks");
    }
}

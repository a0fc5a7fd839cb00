//! The values a synthetic model's tensors hold, and the bytes that encode them: drawn from small grids that every
//! dtype represents exactly, by a seeded generator per tensor. Only `std`.
use super::WeightDType;
use std::io::{self, Write};

/// What a tensor's values are drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Values {
    /// The weight grid `k / 4096`.
    Weight,
    /// `1 + k / 128`, `k` in `-32..=32`.
    Norm,
    /// `k / 128`: a Gemma norm stored as `w - 1`.
    NormMinusOne,
    /// `k / 16` (up to ±7.9): gpt-oss's expert biases, so that its SwiGLU's clamp at ±7 bites, and its sinks, so
    /// that some heads give most of their weight to theirs and others none.
    Large,
    /// `k / 65536`: gpt-oss's expert down projections, so that the experts' clamped activations of up to 7 x 8 do
    /// not drown the attention's output in the residual stream (with them at the weight grid, a model without
    /// sinks gave the same greedy tokens).
    Small,
}

/// A value of the grid [`Values::Large`] draws from.
pub(super) fn large_value(k: i32) -> f32 {
    k as f32 / 16.0
}

/// A value of the grid [`Values::Small`] draws from.
pub(super) fn small_value(k: i32) -> f32 {
    k as f32 / 65536.0
}

/// A norm weight of the grid [`Values::Norm`] draws from, for a random byte's `k`: `1 + (k / 4) / 128`.
pub(super) fn norm_value(k: i32) -> f32 {
    1.0 + (k / 4) as f32 / 128.0
}

/// The encoded bytes of 256 values, indexed by a random byte: byte `b` is `value(b - 128)`, except 0 which is
/// `value(0)`, so values are symmetric around `value(0)`.
pub(super) struct ValueTable {
    size: usize,
    bytes: Vec<u8>,
}

impl ValueTable {
    pub(super) fn new(dtype: WeightDType, value: impl Fn(i32) -> f32) -> Self {
        let bytes = (0..=255u8)
            .flat_map(|b| {
                let k = if b == 0 { 0 } else { i32::from(b) - 128 };
                encode(value(k), dtype)
            })
            .collect();
        Self {
            size: dtype.size_in_bytes(),
            bytes,
        }
    }

    /// Writes `count` random values, eight per generator draw, a chunk at a time.
    pub(super) fn write_random(
        &self,
        out: &mut impl Write,
        count: usize,
        rng: &mut SplitMix64,
    ) -> io::Result<()> {
        const CHUNK: usize = 1 << 16;
        let mut buf = Vec::with_capacity(CHUNK * self.size);
        let mut left = count;
        while left > 0 {
            let n = left.min(CHUNK);
            buf.clear();
            let mut draws = 0;
            let mut word = 0u64;
            for _ in 0..n {
                if draws == 0 {
                    word = rng.next();
                    draws = 8;
                }
                let b = (word & 0xff) as usize;
                word >>= 8;
                draws -= 1;
                buf.extend_from_slice(&self.bytes[b * self.size..(b + 1) * self.size]);
            }
            out.write_all(&buf)?;
            left -= n;
        }
        Ok(())
    }
}

/// Little-endian bytes of `v` in `dtype`. Only exact for values with at most 8 significant bits and an exponent
/// in f16's normal range (every value this module writes); the conversions are done by hand to need no crate.
pub(super) fn encode(v: f32, dtype: WeightDType) -> Vec<u8> {
    let bits = v.to_bits();
    match dtype {
        WeightDType::F32 => bits.to_le_bytes().to_vec(),
        WeightDType::BF16 => ((bits >> 16) as u16).to_le_bytes().to_vec(),
        WeightDType::F16 => f16_bits(v).to_le_bytes().to_vec(),
    }
}

/// The f16 bits of a value that f16 represents exactly as a normal number (or zero).
pub(super) fn f16_bits(v: f32) -> u16 {
    if v == 0.0 {
        return 0;
    }
    let bits = v.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    debug_assert!(
        (1..31).contains(&exp) && bits & 0x1fff == 0,
        "{v} is not exact in f16"
    );
    sign | ((exp as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

/// FNV-1a, to give each tensor its own stream from one seed whatever order tensors are written in.
pub(super) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64: tiny, fast and good enough for weights that only need to look random.
pub(super) struct SplitMix64(pub(super) u64);

impl SplitMix64 {
    pub(super) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

//! Output verification: how often a hop's answer is checked against a second server holding the same blocks, how
//! two answers are compared, who is judged to have lied, and what the checks found.
//!
//! Two honest servers given the same inputs give the same outputs up to rounding: the same weights (the block
//! hashes say so), the same code, but perhaps another device, dtype or batching. So answers are compared row by row
//! (one row per sequence and position) by relative L2 distance, against a tolerance set by the coarsest wire dtype
//! involved. The running of second and third servers lives with the chain ([`crate::chain`]); this module is the
//! arithmetic and the bookkeeping.
use crate::error::Result;
use candle_core::{DType, Tensor, D};
use petal_model::BlockRange;
use petal_proto::pb::{ServerRecord, WireDType};
use serde::Serialize;
use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

/// How many hop steps are checked on a second server.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum VerifyPolicy {
    /// No checks.
    Off,
    /// Each step of each hop is checked with this probability, chosen at random so no server can tell which.
    Sample(f64),
    /// Every step of every hop.
    All,
}

impl VerifyPolicy {
    /// The default: one hop step in twenty. A second server then runs each hop's history too (its steps batched
    /// into few, fast calls), and the client waits for it on the sampled steps only.
    pub const DEFAULT_RATE: f64 = 0.05;

    /// Whether to check the next step, drawn at random.
    pub fn draw(&self) -> bool {
        match *self {
            Self::Off => false,
            Self::All => true,
            Self::Sample(rate) => rand::random::<f64>() < rate,
        }
    }

    pub fn is_off(&self) -> bool {
        *self == Self::Off
    }
}

impl Default for VerifyPolicy {
    fn default() -> Self {
        Self::Sample(Self::DEFAULT_RATE)
    }
}

impl fmt::Display for VerifyPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::All => f.write_str("all"),
            Self::Sample(rate) => write!(f, "{rate}"),
        }
    }
}

impl FromStr for VerifyPolicy {
    type Err = String;

    /// `off`, `all`, a rate in (0, 1] (`0.05`) or a percentage (`5%`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad =
            || format!("--verify takes off, all, a rate in (0, 1] or a percentage; got {s:?}");
        let rate = match s.trim() {
            "off" | "none" => return Ok(Self::Off),
            "all" => return Ok(Self::All),
            pct if pct.ends_with('%') => {
                pct.trim_end_matches('%')
                    .trim()
                    .parse::<f64>()
                    .map_err(|_| bad())?
                    / 100.0
            }
            rate => rate.parse::<f64>().map_err(|_| bad())?,
        };
        if rate == 0.0 {
            Ok(Self::Off)
        } else if rate == 1.0 {
            Ok(Self::All)
        } else if rate > 0.0 && rate < 1.0 {
            Ok(Self::Sample(rate))
        } else {
            Err(bad())
        }
    }
}

/// What decides how close two honest answers are: the wire dtypes, whether the weights are quantized, and the kinds
/// of device that computed them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Numerics {
    /// The coarsest wire dtype involved.
    pub dtype: Option<WireDType>,
    pub quantized: bool,
    /// Device kinds ("cpu", "cuda", "metal") of the servers involved.
    pub devices: BTreeSet<String>,
    /// Their `max_chunk_tokens`: servers that split a long step differently round differently.
    pub chunks: BTreeSet<u32>,
}

impl Numerics {
    /// A server's, from its record and the wire dtype of its session.
    pub fn of_server(record: &ServerRecord, dtype: WireDType) -> Self {
        let devices = record
            .devices
            .iter()
            .map(|d| d.device.split(':').next().unwrap_or_default().to_string())
            .collect();
        Self {
            dtype: Some(dtype),
            quantized: !matches!(record.quantization.as_str(), "" | "none"),
            devices,
            chunks: [record.max_chunk_tokens].into(),
        }
    }

    /// The numerics of answers compared across `self` and `other`.
    pub fn join(mut self, other: &Numerics) -> Self {
        self.dtype = match (self.dtype, other.dtype) {
            (Some(a), Some(b)) => Some(if base_tolerance(b) > base_tolerance(a) {
                b
            } else {
                a
            }),
            (a, b) => a.or(b),
        };
        self.quantized |= other.quantized;
        self.devices.extend(other.devices.iter().cloned());
        self.chunks.extend(other.chunks.iter().copied());
        self
    }

    /// Largest relative L2 distance between two honest answers' rows.
    ///
    /// Servers with the same kind of device run the same kernels and, given the same steps, agree bit for bit
    /// (measured: 0.0 on CPU, f32 and Q4_1); the bound by wire dtype leaves room for rounding while a perturbation
    /// of 0.1% of an f32 hidden state is still caught. Different devices round differently: about 1e-6 apart per
    /// block for dense weights, but kernels that quantize activations to 8 bits (quantized weights) turn such
    /// differences into about 1e-2 over 30 blocks (model/tests/chunking.rs), so mixed devices get 10x, and 50x
    /// with quantized weights. So do servers that split long steps into chunks of different sizes.
    pub fn tolerance(&self) -> f32 {
        let base = base_tolerance(self.dtype.unwrap_or(WireDType::F32));
        match (
            self.devices.len() > 1 || self.chunks.len() > 1,
            self.quantized,
        ) {
            (false, _) => base,
            (true, false) => base * 10.0,
            (true, true) => base * 50.0,
        }
    }
}

/// Bound for answers of the same kernels in `dtype`: f16 and bf16 answers carry 11 and 8 significant bits.
fn base_tolerance(dtype: WireDType) -> f32 {
    match dtype {
        WireDType::F32 | WireDType::Unspecified => 1e-3,
        WireDType::F16 => 1e-2,
        WireDType::Bf16 => 4e-2,
    }
}

/// The largest, over rows (one per sequence and position), of `|a - b| / max(|a|, |b|)` with L2 norms over the
/// hidden dimension: 0 for equal answers, 2 for opposite ones, scale-free.
pub fn deviation(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok(row_deviation(a, b).map_err(petal_model::ModelError::from)?)
}

fn row_deviation(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    let dim = a.dim(D::Minus1)?;
    let a = a.to_dtype(DType::F32)?.reshape(((), dim))?;
    let b = b.to_dtype(DType::F32)?.reshape(((), dim))?;
    let norm = |t: &Tensor| t.sqr()?.sum(1)?.sqrt()?.to_vec1::<f32>();
    let diff = norm(&(&a - &b)?)?;
    let (na, nb) = (norm(&a)?, norm(&b)?);
    let worst = diff
        .iter()
        .zip(na.iter().zip(&nb))
        .map(|(d, (x, y))| d / x.max(*y).max(f32::MIN_POSITIVE))
        .fold(0.0f32, f32::max);
    Ok(worst)
}

/// Who a check blames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The two answers agree.
    Agreed,
    /// The checked hop's server disagrees with two others that agree with each other.
    PrimaryDeviated,
    /// The second chain disagrees with the hop's server and a third chain that agree with each other.
    SecondDeviated,
    /// The two disagree and no third chain exists, or all three disagree: nobody can be blamed.
    Unresolved,
}

/// Deviations between the answers of the hop's server (primary), a second chain and, on mismatch, a third.
#[derive(Debug, Clone, Copy)]
pub struct Opinions {
    pub primary_second: f32,
    /// `(primary vs third, second vs third)`, when a third chain answered.
    pub third: Option<(f32, f32)>,
}

/// The majority rule: two answers that agree within `tolerance` outvote a third.
pub fn judge(opinions: Opinions, tolerance: f32) -> Verdict {
    if opinions.primary_second <= tolerance {
        return Verdict::Agreed;
    }
    match opinions.third {
        Some((_, second_third)) if second_third <= tolerance => Verdict::PrimaryDeviated,
        Some((primary_third, _)) if primary_third <= tolerance => Verdict::SecondDeviated,
        _ => Verdict::Unresolved,
    }
}

/// A check whose answers disagreed.
#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    /// The checked hop's blocks and the position of the step's first token.
    pub blocks: BlockRange,
    pub position: usize,
    pub tokens: usize,
    /// The hop's server, and the peers of the second and third chains (empty when there was no third).
    pub primary: String,
    pub second: Vec<String>,
    pub third: Vec<String>,
    /// Primary vs second, and the tolerance it was held to.
    pub deviation: f32,
    pub tolerance: f32,
    pub verdict: Verdict,
    /// Peers banned for it (the deviating side).
    pub banned: Vec<String>,
}

/// What a session's checks found, cumulative (a completion reports the difference over its steps).
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyTally {
    /// Hop steps compared with a second server, and the tokens they carried.
    pub checked_steps: u64,
    pub checked_tokens: u64,
    /// Steps drawn for a check that could not have one: no other server holds the hop's blocks.
    pub unverifiable: u64,
    /// Steps drawn for a check whose second server failed (it was banned; the step was not checked).
    pub skipped: u64,
    /// Every check that disagreed, in order.
    pub mismatches: Vec<Mismatch>,
}

impl VerifyTally {
    /// What happened after `before` (an earlier copy of this tally).
    pub fn since(&self, before: &VerifyTally) -> VerifyTally {
        VerifyTally {
            checked_steps: self.checked_steps - before.checked_steps.min(self.checked_steps),
            checked_tokens: self.checked_tokens - before.checked_tokens.min(self.checked_tokens),
            unverifiable: self.unverifiable - before.unverifiable.min(self.unverifiable),
            skipped: self.skipped - before.skipped.min(self.skipped),
            mismatches: self.mismatches[before.mismatches.len().min(self.mismatches.len())..]
                .to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn parses_policies() {
        assert_eq!("off".parse(), Ok(VerifyPolicy::Off));
        assert_eq!("0".parse(), Ok(VerifyPolicy::Off));
        assert_eq!("all".parse(), Ok(VerifyPolicy::All));
        assert_eq!("1".parse(), Ok(VerifyPolicy::All));
        assert_eq!("0.05".parse(), Ok(VerifyPolicy::Sample(0.05)));
        assert_eq!("5%".parse(), Ok(VerifyPolicy::Sample(0.05)));
        for bad in ["", "-0.1", "1.5", "some", "200%", "NaN"] {
            assert!(bad.parse::<VerifyPolicy>().is_err(), "{bad:?} accepted");
        }
        assert_eq!(VerifyPolicy::default().to_string(), "0.05");
    }

    #[test]
    fn draws_follow_the_rate() {
        assert!((0..100).all(|_| VerifyPolicy::All.draw()));
        assert!((0..100).all(|_| !VerifyPolicy::Off.draw()));
        let hits = (0..20_000)
            .filter(|_| VerifyPolicy::Sample(0.05).draw())
            .count();
        // 1,000 expected; a binomial's standard deviation here is about 31.
        assert!((800..1200).contains(&hits), "{hits} of 20000");
    }

    #[test]
    fn deviation_is_the_worst_row_relative_distance() {
        let dev = Device::Cpu;
        let a = Tensor::new(&[[[3f32, 4.0], [1.0, 0.0]]], &dev).unwrap();
        assert_eq!(deviation(&a, &a).unwrap(), 0.0);
        // Second row off by 0.1 of its norm 1; the first row is exact.
        let b = Tensor::new(&[[[3f32, 4.0], [1.0, 0.1]]], &dev).unwrap();
        let d = deviation(&a, &b).unwrap();
        assert!((d - 0.1 / 1.01f32.sqrt()).abs() < 1e-6, "{d}");
        // Scale-free: a large row off by the same fraction deviates as much.
        let big = (a.clone() * 1000.0).unwrap();
        let big_b = (b * 1000.0).unwrap();
        assert!((deviation(&big, &big_b).unwrap() - d).abs() < 1e-5);
        // Zero rows on both sides are equal, not NaN.
        let z = Tensor::zeros((1, 2, 2), DType::F32, &dev).unwrap();
        assert_eq!(deviation(&z, &z).unwrap(), 0.0);
    }

    #[test]
    fn tolerance_follows_dtype_devices_and_quantization() {
        let server = |device: &str, quantization: &str, dtype| {
            let record = ServerRecord {
                quantization: quantization.into(),
                devices: vec![petal_proto::pb::DeviceInfo {
                    device: device.into(),
                    ..Default::default()
                }],
                ..Default::default()
            };
            Numerics::of_server(&record, dtype)
        };
        let cpu = server("cpu", "q4_1", WireDType::F32);
        assert_eq!(
            cpu.clone()
                .join(&server("cpu", "q4_1", WireDType::F32))
                .tolerance(),
            1e-3
        );
        assert_eq!(
            cpu.clone()
                .join(&server("cpu", "q4_1", WireDType::Bf16))
                .tolerance(),
            4e-2
        );
        let mixed = cpu.join(&server("cuda:1", "q4_1", WireDType::F32));
        assert_eq!(mixed.tolerance(), 5e-2);
        let dense =
            server("cpu", "none", WireDType::F16).join(&server("cuda:0", "none", WireDType::F16));
        assert!((dense.tolerance() - 0.1).abs() < 1e-6);
        let chunked = |limit| {
            let record = ServerRecord {
                quantization: "q4_1".into(),
                max_chunk_tokens: limit,
                ..Default::default()
            };
            Numerics::of_server(&record, WireDType::F32)
        };
        assert_eq!(chunked(512).join(&chunked(512)).tolerance(), 1e-3);
        assert_eq!(chunked(512).join(&chunked(64)).tolerance(), 5e-2);
    }

    #[test]
    fn two_that_agree_outvote_the_third() {
        let tol = Numerics::default().tolerance();
        let agree = Opinions {
            primary_second: 1e-6,
            third: None,
        };
        assert_eq!(judge(agree, tol), Verdict::Agreed);
        let lone = Opinions {
            primary_second: 0.3,
            third: None,
        };
        assert_eq!(judge(lone, tol), Verdict::Unresolved);
        let primary_lies = Opinions {
            primary_second: 0.3,
            third: Some((0.3, 1e-6)),
        };
        assert_eq!(judge(primary_lies, tol), Verdict::PrimaryDeviated);
        let second_lies = Opinions {
            primary_second: 0.3,
            third: Some((1e-6, 0.3)),
        };
        assert_eq!(judge(second_lies, tol), Verdict::SecondDeviated);
        let all_differ = Opinions {
            primary_second: 0.3,
            third: Some((0.2, 0.1)),
        };
        assert_eq!(judge(all_differ, tol), Verdict::Unresolved);
    }
}

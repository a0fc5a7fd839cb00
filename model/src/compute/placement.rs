//! Where a tensor lives and in what dtype, and the one function that moves it there.
//!
//! Multi-device inference breaks when placement is implicit (a CPU past-key concatenated with CUDA keys). Here every
//! block has a [`Placement`], and every tensor that enters a block (activations off the wire or from the previous
//! block, KV restored or replayed into a cache) goes through [`normalise`] first.
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use std::fmt;

/// The device and dtype a block computes in.
#[derive(Debug, Clone)]
pub struct Placement {
    pub device: Device,
    pub dtype: DType,
}

impl Placement {
    pub fn new(device: Device, dtype: DType) -> Self {
        Self { device, dtype }
    }

    pub fn cpu_f32() -> Self {
        Self::new(Device::Cpu, DType::F32)
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            device_name(&self.device),
            dtype_name(self.dtype)
        )
    }
}

/// Moves `t` to the placement's device, then casts it to the placement's dtype; a no-op when both already match.
///
/// Device first, then dtype: the cast then runs on the target device, and a bf16 tensor never has to exist on a
/// backend that lacks bf16 kernels.
pub fn normalise(t: &Tensor, p: &Placement) -> Result<Tensor> {
    let t = if t.device().same_device(&p.device) {
        t.clone()
    } else {
        t.to_device(&p.device)?
    };
    Ok(if t.dtype() == p.dtype {
        t
    } else {
        t.to_dtype(p.dtype)?
    })
}

/// True when `t` already sits where `p` says.
pub fn is_placed(t: &Tensor, p: &Placement) -> bool {
    t.device().same_device(&p.device) && t.dtype() == p.dtype
}

pub fn dtype_name(dtype: DType) -> &'static str {
    dtype.as_str()
}

/// Parses `f32`, `f16`, `bf16` (what `--dtype` accepts).
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(ModelError::Config(format!(
            "unknown dtype {other:?}: expected f32, f16 or bf16"
        ))),
    }
}

/// A device as the user names it: `cpu`, `cuda:N`, `metal:N` or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
    Metal(usize),
    /// The first GPU this build can use, else the CPU.
    Auto,
}

impl DeviceSpec {
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        let bad = || ModelError::Device {
            asked: s.clone(),
            reason: "expected cpu, cuda:N, metal:N or auto".into(),
            available: available_devices().join(", "),
        };
        match s.as_str() {
            "cpu" => return Ok(Self::Cpu),
            "auto" => return Ok(Self::Auto),
            "cuda" => return Ok(Self::Cuda(0)),
            "metal" => return Ok(Self::Metal(0)),
            _ => {}
        }
        let (kind, idx) = s.split_once(':').ok_or_else(bad)?;
        let idx: usize = idx.parse().map_err(|_| bad())?;
        match kind {
            "cuda" => Ok(Self::Cuda(idx)),
            "metal" => Ok(Self::Metal(idx)),
            _ => Err(bad()),
        }
    }

    /// Opens the device, or says clearly why it cannot: not compiled in, or not present.
    pub fn open(self) -> Result<Device> {
        let err = |reason: String| ModelError::Device {
            asked: self.to_string(),
            reason,
            available: available_devices().join(", "),
        };
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Auto => {
                if cuda_device_count() > 0 {
                    Self::Cuda(0).open()
                } else if metal_device_count() > 0 {
                    Self::Metal(0).open()
                } else {
                    Ok(Device::Cpu)
                }
            }
            Self::Cuda(i) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(err(
                        "this build has no CUDA support (rebuild with --features cuda)".into(),
                    ));
                }
                let n = cuda_device_count();
                if i >= n {
                    return Err(err(format!(
                        "{n} CUDA device(s) visible (CUDA_VISIBLE_DEVICES applies)"
                    )));
                }
                super::cuda::open(i).map_err(err)
            }
            Self::Metal(i) => {
                if !candle_core::utils::metal_is_available() {
                    return Err(err(
                        "this build has no Metal support (rebuild with --features metal)".into(),
                    ));
                }
                let n = metal_device_count();
                if i >= n {
                    return Err(err(format!("{n} Metal device(s) present")));
                }
                Device::new_metal(i).map_err(|e| err(e.to_string()))
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
            Self::Metal(i) => write!(f, "metal:{i}"),
            Self::Auto => write!(f, "auto"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

/// A device's name as users write it (`cpu`, `cuda:0`, `metal:0`).
pub fn device_name(d: &Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Every device this build can open on this machine.
pub fn available_devices() -> Vec<String> {
    let mut v = vec!["cpu".to_string()];
    v.extend((0..cuda_device_count()).map(|i| format!("cuda:{i}")));
    v.extend((0..metal_device_count()).map(|i| format!("metal:{i}")));
    v
}

/// Visible CUDA devices (CUDA_VISIBLE_DEVICES applies); 0 without the `cuda` feature or without a driver.
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        // A missing driver (libcuda.so.1) makes cudarc panic on first use; contain it so start-up reports
        // "0 CUDA devices" instead of crashing.
        std::panic::catch_unwind(|| {
            candle_core::cuda::cudarc::driver::CudaContext::device_count()
                .map(|n| n.max(0) as usize)
                .unwrap_or(0)
        })
        .unwrap_or(0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Metal devices present; 0 without the `metal` feature.
pub fn metal_device_count() -> usize {
    #[cfg(feature = "metal")]
    {
        candle_core::MetalDevice::all_devices().len()
    }
    #[cfg(not(feature = "metal"))]
    {
        0
    }
}

/// Free and total memory of a device in bytes, when the backend can tell (CUDA); None on CPU and Metal.
pub fn device_memory(d: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = d {
        return c
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(free, total)| (free as u64, total as u64));
    }
    let _ = d;
    None
}

/// The devices a test runs on: the CPU, and the first CUDA GPU in builds that have one and on machines that have
/// one (elsewhere opening it is an error, and the test runs on the CPU alone).
#[cfg(test)]
pub(crate) fn test_devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    if let Ok(gpu) = DeviceSpec::Cuda(0).open() {
        devices.push(gpu);
    }
    devices
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalise_converts_dtype_and_keeps_values() {
        let t = Tensor::new(&[1.5f32, -2.25, 3.0], &Device::Cpu).unwrap();
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            let p = Placement::new(Device::Cpu, dtype);
            let n = normalise(&t, &p).unwrap();
            assert!(is_placed(&n, &p));
            let back = normalise(&n, &Placement::cpu_f32()).unwrap();
            assert_eq!(back.to_vec1::<f32>().unwrap(), vec![1.5, -2.25, 3.0]);
        }
    }

    #[test]
    fn parses_devices() {
        assert_eq!(DeviceSpec::parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
        assert_eq!(DeviceSpec::parse("METAL:0").unwrap(), DeviceSpec::Metal(0));
        assert_eq!(DeviceSpec::parse("auto").unwrap(), DeviceSpec::Auto);
        assert!(DeviceSpec::parse("tpu:0").is_err());
        assert!(DeviceSpec::parse("cuda:x").is_err());
    }

    #[test]
    fn absent_device_is_a_clear_error() {
        if cuda_device_count() > 0 {
            return;
        }
        let err = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
        assert!(err.contains("cuda:0"), "{err}");
        assert!(err.contains("available: cpu"), "{err}");
        assert!(DeviceSpec::Auto.open().unwrap().is_cpu());
    }
}

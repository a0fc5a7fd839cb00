//! Where each served block lives: one device, or a span split across several (`--devices cuda:0,cuda:1`), in
//! proportion to free memory or as `--split 6,4` says.
use crate::{NodeError, Result};
use candle_core::{DType, Device};
use petal_model::compute::placement::{device_memory, device_name, DeviceSpec};
use petal_model::{BlockRange, Placement};
use petal_proto::pb;

/// Opens every device asked for; an absent device or a build without its backend fails here, at start-up.
pub fn open_devices(specs: &[DeviceSpec]) -> Result<Vec<Device>> {
    if specs.is_empty() {
        return Err(NodeError::Devices("no device given".into()));
    }
    specs.iter().map(|s| Ok(s.open()?)).collect()
}

/// Blocks per device: `split` when given (must add up to the span), else in proportion to free memory (equal
/// shares where memory is unknown), each device getting at least one block.
pub fn plan_split(
    blocks: usize,
    devices: &[Device],
    split: Option<&[usize]>,
) -> Result<Vec<usize>> {
    if let Some(split) = split {
        if split.len() != devices.len() {
            return Err(NodeError::Devices(format!(
                "--split has {} parts for {} devices",
                split.len(),
                devices.len()
            )));
        }
        if split.iter().sum::<usize>() != blocks || split.contains(&0) {
            return Err(NodeError::Devices(format!(
                "--split {split:?} must give every device at least one block and add up to {blocks}"
            )));
        }
        return Ok(split.to_vec());
    }
    if devices.len() > blocks {
        return Err(NodeError::Devices(format!(
            "{} devices for {blocks} blocks: each device needs at least one block",
            devices.len()
        )));
    }
    let free: Vec<f64> = devices
        .iter()
        .map(|d| device_memory(d).map(|(f, _)| f as f64).unwrap_or(0.0))
        .collect();
    let weights: Vec<f64> = if free.iter().all(|f| *f > 0.0) {
        free
    } else {
        vec![1.0; devices.len()]
    };
    let total: f64 = weights.iter().sum();
    // Largest-remainder apportionment with a floor of one block each.
    let spare = blocks - devices.len();
    let exact: Vec<f64> = weights.iter().map(|w| w / total * spare as f64).collect();
    let mut counts: Vec<usize> = exact.iter().map(|e| 1 + e.floor() as usize).collect();
    let mut order: Vec<usize> = (0..devices.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for &i in order
        .iter()
        .cycle()
        .take(blocks - counts.iter().sum::<usize>())
    {
        counts[i] += 1;
    }
    Ok(counts)
}

/// One placement per block of `range`.
pub fn placements(devices: &[Device], counts: &[usize], dtype: DType) -> Vec<Placement> {
    devices
        .iter()
        .zip(counts)
        .flat_map(|(d, &n)| std::iter::repeat_n(Placement::new(d.clone(), dtype), n))
        .collect()
}

/// The devices as announced in the DHT record.
pub fn device_infos(
    devices: &[Device],
    counts: &[usize],
    range: BlockRange,
) -> Vec<pb::DeviceInfo> {
    let mut start = range.start;
    devices
        .iter()
        .zip(counts)
        .map(|(d, &n)| {
            let (free, total) = device_memory(d).unwrap_or((0, 0));
            let info = pb::DeviceInfo {
                device: device_name(d),
                start_block: start as u32,
                end_block: (start + n) as u32,
                free_memory_bytes: free,
                total_memory_bytes: total,
            };
            start += n;
            info
        })
        .collect()
}

/// Parses `--devices cpu,cuda:0`.
pub fn parse_devices(s: &str) -> Result<Vec<DeviceSpec>> {
    s.split(',')
        .map(|d| {
            DeviceSpec::parse(d).map_err(|source| NodeError::Device {
                list: s.to_string(),
                source,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_evenly_without_memory_figures() {
        let devs = vec![Device::Cpu, Device::Cpu, Device::Cpu];
        assert_eq!(plan_split(10, &devs, None).unwrap(), vec![4, 3, 3]);
        assert_eq!(plan_split(3, &devs, None).unwrap(), vec![1, 1, 1]);
        assert!(plan_split(2, &devs, None).is_err());
    }

    #[test]
    fn explicit_split_is_checked() {
        let devs = vec![Device::Cpu, Device::Cpu];
        assert_eq!(plan_split(10, &devs, Some(&[6, 4])).unwrap(), vec![6, 4]);
        assert!(plan_split(10, &devs, Some(&[6, 3])).is_err());
        assert!(plan_split(10, &devs, Some(&[10, 0])).is_err());
        assert!(plan_split(10, &devs, Some(&[10])).is_err());
    }

    #[test]
    fn a_bad_device_names_the_flag_and_what_is_available() {
        let err = parse_devices("cpu,gpu:x").unwrap_err();
        assert!(matches!(err, NodeError::Device { .. }), "{err:?}");
        let cause = std::error::Error::source(&err).map(ToString::to_string);
        let text = format!("{err}: {}", cause.unwrap_or_default());
        assert!(text.starts_with("in --devices cpu,gpu:x: "), "{text}");
        assert!(
            text.contains("\"gpu:x\"") && text.contains("available: cpu"),
            "{text}"
        );
    }

    #[test]
    fn placements_follow_the_split() {
        let p = placements(&[Device::Cpu, Device::Cpu], &[2, 1], DType::F16);
        assert_eq!(p.len(), 3);
        assert!(p.iter().all(|p| p.dtype == DType::F16));
        let infos = device_infos(&[Device::Cpu, Device::Cpu], &[2, 1], BlockRange::new(4, 7));
        assert_eq!((infos[1].start_block, infos[1].end_block), (6, 7));
    }
}

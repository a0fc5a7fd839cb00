//! Opening a CUDA device for the way Petal uses it: a decode step is many small kernels, and the host's work to
//! launch them, not their arithmetic, sets its time.
//!
//! cudarc's event tracking creates two CUDA events with every allocation and destroys them with every free, so
//! that a buffer shared between streams can be waited for. It records them only once a stream has been created
//! (its multi-stream mode), which neither candle's default device nor Petal ever does: four driver calls per op
//! that synchronise nothing. Measured on an H200 with SmolLM2 (docs/benchmarks.md, GPU runs): the host's time
//! per block and token 311 -> 272 us, a 16-session step's blocks 20.2 -> 17.4-18.3 ms.
use candle_core::Device;

/// CUDA device `ordinal`, without cudarc's event tracking (see the module docs).
pub(crate) fn open(ordinal: usize) -> Result<Device, String> {
    let device = Device::new_cuda(ordinal).map_err(|e| e.to_string())?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = &device {
        // SAFETY: cudarc waits on these events only in its multi-stream mode, which starts when a stream is
        // created; nothing in Petal creates one, so turning them off changes no synchronisation. Tensors made
        // after this call carry no events.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(device)
}

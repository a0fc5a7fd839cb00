//! The one error type of the node's public API. Wrapping errors keep their cause as [`std::error::Error::source`]
//! instead of repeating it, so `{:#}` (anyhow) prints each cause once: "in --devices gpu: device \"gpu\" is not
//! available (...); available: cpu".
use std::net::SocketAddr;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A bad model file, block range or device (said by the model crate, which names what was wrong), or a span
    /// that failed to load or compute.
    #[error(transparent)]
    Model(#[from] petal_model::ModelError),
    /// The span scheduler's thread could not start.
    #[error(transparent)]
    Scheduler(#[from] petal_model::SchedulerError),
    /// The libp2p network could not start or accept streams.
    #[error(transparent)]
    Net(#[from] petal_p2p::NetError),
    /// One entry of `--devices LIST` that is not a device name.
    #[error("in --devices {list}")]
    Device {
        list: String,
        #[source]
        source: petal_model::ModelError,
    },
    /// Devices and `--split` that do not fit together or the span (no device, wrong number of parts, a device
    /// with no block).
    #[error("{0}")]
    Devices(String),
    /// Limits that cannot work together (a receive buffer smaller than a frame, a step memory budget smaller than
    /// one step at full context).
    #[error("{0}")]
    Limits(String),
    /// A span or its smallest KV cache that the memory budget cannot hold (every size in the message).
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    /// The `--metrics-listen` address cannot be bound (taken port, bad interface).
    #[error("cannot listen for metrics on {addr} (--metrics-listen)")]
    MetricsBind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// Any other I/O failure of a socket the node holds.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A tensor operation outside the model crate (the start-up throughput probe).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A start-up task on the blocking pool (loading the span, measuring throughput) panicked or was cancelled.
    #[error("{task} did not finish")]
    Join {
        task: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
}

/// The node's result type.
pub type Result<T, E = NodeError> = std::result::Result<T, E>;

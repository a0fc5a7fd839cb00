//! petal-node: hosts a span of transformer blocks and serves inference sessions over libp2p.
//!
//! [`Node::start`] loads the span onto its devices, joins the swarm, announces itself in the DHT and serves each
//! incoming inference stream in its own task ([`handler`]); [`admission`] keeps sessions within the cache budget;
//! [`metrics`] serves Prometheus metrics.
pub mod admission;
pub mod devices;
pub mod handler;
pub mod logging;
pub mod metrics;
pub mod server;

pub use server::{start_bootstrap, Node, NodeConfig, ServerContext};

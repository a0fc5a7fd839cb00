//! petal-node: hosts a span of transformer blocks and serves inference sessions over libp2p.
//!
//! [`Node::start`] loads the span onto its devices ([`devices`]), joins the swarm, announces itself in the DHT and
//! serves each incoming inference stream in its own task ([`handler`]) over the state they share ([`context`]);
//! [`admission`] keeps sessions within the cache budget and each peer to its fair share; [`limits`] bounds what
//! else a peer may make the node spend; [`metrics`] serves Prometheus metrics. Every fallible
//! public function returns a [`NodeError`].
//!
//! Modules depend one way: `server` -> `handler` -> `context` -> `admission`, `limits`, `metrics`.
pub mod admission;
pub mod context;
pub mod devices;
pub mod error;
pub mod handler;
pub mod limits;
pub mod metrics;
pub mod server;

pub use context::ServerContext;
pub use error::{NodeError, Result};
pub use server::{start_bootstrap, Node, NodeConfig};

//! petal-node: hosts a span of transformer blocks and serves inference sessions over libp2p.
//!
//! [`Node::start`] opens the model and its devices ([`loader`], [`devices`]), joins the swarm, picks its span
//! (given, or where the swarm needs it: [`balance`]), announces itself in the DHT and serves each incoming
//! inference stream in its own task ([`handler`]) over the state they share ([`context`]); [`serving`] switches
//! to another span when the balancer moves the node; [`memory`] plans the span, its KV cache and workspace within the memory budget; [`admission`] keeps sessions within the cache budget and
//! each peer to its fair share; [`limits`] bounds what else a peer may make the node spend; [`push`] forwards
//! outputs straight to the next server of a client's route; [`metrics`] serves Prometheus metrics. Every fallible public function returns a [`NodeError`].
//!
//! Modules depend one way: `server` -> `balance` -> `serving` -> `loader`, `handler` -> `context` ->
//! `admission`, `limits`, `metrics`.
pub mod admission;
pub mod balance;
pub mod context;
pub mod devices;
pub mod error;
pub mod handler;
pub mod limits;
pub mod loader;
pub mod memory;
pub mod metrics;
pub mod push;
pub mod server;
pub mod serving;

pub use balance::balancer::BalanceConfig;
pub use context::ServerContext;
pub use error::{NodeError, Result};
pub use server::{start_bootstrap, Node, NodeConfig, SpanChoice};

//! petal-cli: the binaries (`petal`, `petal-node`, `petal-bench`) and what they share: the plumbing around every
//! `main` ([`app`], [`logging`], [`seconds`]) and an in-process swarm on loopback ([`local_swarm`]) for the demo,
//! the bench and the tests. The library crates (petal-client, petal-node, petal-model) have no CLI of their own.
pub mod app;
pub mod local_swarm;
pub mod logging;
pub mod seconds;

pub use local_swarm::{LocalSwarm, LocalSwarmError};

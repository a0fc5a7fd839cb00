//! petal-cli: the binaries (`petal`, `petal-node`, `petal-bench`) and what they share: the plumbing around every
//! `main` ([`app`], [`logging`], [`seconds`], [`hub`] for `--model org/name`) and an in-process swarm on loopback
//! ([`local_swarm`]) for the demo, the bench and the tests. The library crates (petal-client, petal-node, petal-model) have no CLI of their own.
pub mod app;
pub mod hub;
pub mod local_swarm;
pub mod logging;
pub mod seconds;

pub use local_swarm::{LocalSwarm, LocalSwarmError};

/// The private swarm's key from `--swarm-key FILE`, when given (every binary takes the flag).
pub fn load_swarm_key(
    path: Option<&std::path::Path>,
) -> anyhow::Result<Option<petal_p2p::swarm_key::PreSharedKey>> {
    Ok(path.map(petal_p2p::swarm_key::load_from_file).transpose()?)
}

//! petal-client: generate text through a Petal swarm.
//!
//! [`SwarmClient`] joins the swarm and finds servers in the DHT; [`router`] chains spans that cover the model;
//! [`HopClient`] speaks the per-hop protocol to one server; [`ChainSession`] streams hidden states through a chain
//! of hops, replaces failed servers and checks a sample of their answers on others ([`verification`]). [`ModelBlocks`] is "the blocks of a model", in this process
//! ([`LocalSpans`]) or on a chain ([`RemoteChain`]); [`Generator`] is the one decode loop over either, on a session
//! a [`Conversation`] can keep across chat turns.
pub mod bans;
pub mod blocks;
pub mod chain;
pub mod conversation;
pub mod error;
pub mod generator;
pub mod hop;
pub mod router;
pub mod swarm;
pub mod verification;

pub use blocks::{BlockSession, BlocksOutput, LocalSpans, ModelBlocks, RemoteChain};
pub use chain::{ChainConfig, ChainSession, Failover, HopTiming, RouteHop};
pub use conversation::{Conversation, Turn};
pub use error::ClientError;
pub use generator::{Completion, Cost, Generator, Session, StepTiming};
pub use hop::{HopClient, HopStep};
pub use router::{plan_range, Hop};
pub use swarm::SwarmClient;
pub use verification::{Mismatch, Verdict, VerifyPolicy, VerifyTally};

/// Durations as fractional milliseconds in JSON reports.
pub(crate) fn serde_ms<S: serde::Serializer>(
    d: &std::time::Duration,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

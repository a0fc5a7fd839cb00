//! "The blocks of a model": every transformer block between the embeddings and the final norm, wherever they run.
//! [`LocalSpans`] runs them in this process; [`RemoteChain`] on a chain of servers. The one decode loop
//! ([`crate::Generator`]) drives either through these two traits and never knows which it has.
mod local;
mod remote;

pub use local::{LocalSpans, LocalSpansSession};
pub use remote::RemoteChain;

use crate::chain::{Failover, HopTiming, RouteHop};
use crate::error::Result;
use crate::verification::VerifyTally;
use candle_core::Tensor;
use futures::future::BoxFuture;

/// A model's blocks, ready to open sessions on.
pub trait ModelBlocks: Send + Sync {
    /// Opens a session able to hold `max_length` positions (through the swarm: over a freshly planned chain).
    fn open(&self, max_length: usize) -> BoxFuture<'_, Result<Box<dyn BlockSession>>>;
}

/// One sequence's state in the blocks: the KV caches of every position processed so far.
pub trait BlockSession: Send {
    /// Positions processed so far (the next step's first position).
    fn position(&self) -> usize;

    /// Positions the session can hold.
    fn max_length(&self) -> usize;

    /// Raises the positions the session can hold to `max_length` (never lowers it), keeping what it holds.
    fn extend(&mut self, max_length: usize) -> BoxFuture<'_, Result<()>>;

    /// Runs `hidden` (`[batch, tokens, hidden]`) for the next positions through every block, in order.
    fn forward<'a>(&'a mut self, hidden: &'a Tensor) -> BoxFuture<'a, Result<BlocksOutput>>;

    /// `name(peer)[a..b]` per hop through the swarm; empty when the blocks run here.
    fn route(&self) -> Vec<String> {
        vec![]
    }

    /// Each hop's server, blocks and path (direct or relayed); empty when the blocks run here.
    fn hops(&self) -> Vec<RouteHop> {
        vec![]
    }

    /// Bytes sent and received over the network so far.
    fn bytes_on_wire(&self) -> u64 {
        0
    }

    /// Servers replaced so far.
    fn failovers(&self) -> &[Failover] {
        &[]
    }

    /// What the checks of servers' answers found so far; empty when the blocks run here.
    fn verification(&self) -> VerifyTally {
        VerifyTally::default()
    }

    /// Frees the session (the servers' KV caches for a remote one).
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// What one forward through the blocks returned.
pub struct BlocksOutput {
    /// The last block's hidden states.
    pub hidden: Tensor,
    /// Per hop of a remote chain, in order: its round trip and the server's compute; empty when local.
    pub hops: Vec<HopTiming>,
}

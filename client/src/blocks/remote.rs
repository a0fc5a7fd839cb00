//! The blocks on a chain of servers found through the swarm.
use super::{BlockSession, BlocksOutput, ModelBlocks};
use crate::chain::{ChainConfig, ChainSession, Failover, RouteHop};
use crate::error::Result;
use crate::swarm::SwarmClient;
use crate::verification::VerifyTally;
use candle_core::Tensor;
use futures::future::BoxFuture;
use futures::FutureExt;

/// Every block of one model (by id), served by whoever the swarm has.
pub struct RemoteChain {
    client: SwarmClient,
    model_id: String,
    num_blocks: usize,
    config: ChainConfig,
}

impl RemoteChain {
    pub fn new(
        client: SwarmClient,
        model_id: String,
        num_blocks: usize,
        config: ChainConfig,
    ) -> Self {
        Self {
            client,
            model_id,
            num_blocks,
            config,
        }
    }

    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    pub fn client(&self) -> &SwarmClient {
        &self.client
    }

    /// A session over a freshly planned chain, as its own type (the bench reads its route between steps).
    pub async fn open_chain(&self, max_length: usize) -> Result<ChainSession> {
        ChainSession::open(
            &self.client,
            &self.model_id,
            self.num_blocks,
            max_length,
            self.config.clone(),
        )
        .await
    }
}

impl ModelBlocks for RemoteChain {
    fn open(&self, max_length: usize) -> BoxFuture<'_, Result<Box<dyn BlockSession>>> {
        async move {
            let session = self.open_chain(max_length).await?;
            Ok(Box::new(session) as Box<dyn BlockSession>)
        }
        .boxed()
    }
}

impl BlockSession for ChainSession {
    fn position(&self) -> usize {
        ChainSession::position(self)
    }

    fn max_length(&self) -> usize {
        ChainSession::max_length(self)
    }

    fn extend(&mut self, max_length: usize) -> BoxFuture<'_, Result<()>> {
        ChainSession::extend(self, max_length).boxed()
    }

    fn forward<'a>(&'a mut self, hidden: &'a Tensor) -> BoxFuture<'a, Result<BlocksOutput>> {
        async move {
            let (hidden, hops) = self.step(hidden).await?;
            Ok(BlocksOutput { hidden, hops })
        }
        .boxed()
    }

    fn route(&self) -> Vec<String> {
        ChainSession::route(self)
    }

    fn hops(&self) -> Vec<RouteHop> {
        ChainSession::hops(self)
    }

    fn bytes_on_wire(&self) -> u64 {
        ChainSession::bytes_on_wire(self)
    }

    fn failovers(&self) -> &[Failover] {
        ChainSession::failovers(self)
    }

    fn verification(&self) -> VerifyTally {
        ChainSession::verification(self).clone()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        ChainSession::close(*self).boxed()
    }
}

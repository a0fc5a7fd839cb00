//! One connection's side of the inference-stream protocol: queues inbound streams for the acceptor and negotiates
//! the outbound streams asked for, each carrying its own reply channel so several negotiate at once.
use std::collections::VecDeque;
use std::convert::Infallible;
use std::task::{Context, Poll};

use libp2p::{
    swarm::{
        handler::{
            ConnectionEvent, DialUpgradeError, FullyNegotiatedInbound, FullyNegotiatedOutbound,
        },
        ConnectionHandler, ConnectionHandlerEvent, StreamUpgradeError, SubstreamProtocol,
    },
    PeerId, StreamProtocol,
};
use tokio::sync::mpsc::error::TrySendError;

use super::{upgrade::Upgrade, Acceptor, OpenStreamError, StreamReply};

pub struct Handler {
    protocol: StreamProtocol,
    acceptor: Acceptor,
    /// Outbound streams asked for and not yet requested from the connection.
    requested: VecDeque<StreamReply>,
    remote: PeerId,
}

impl Handler {
    pub(super) fn new(protocol: StreamProtocol, acceptor: Acceptor, remote: PeerId) -> Self {
        Self {
            protocol,
            acceptor,
            requested: VecDeque::new(),
            remote,
        }
    }

    fn accepting(&self) -> bool {
        let acceptor = self.acceptor.lock().unwrap_or_else(|e| e.into_inner());
        acceptor.as_ref().is_some_and(|s| !s.is_closed())
    }
}

impl ConnectionHandler for Handler {
    type FromBehaviour = StreamReply;
    type ToBehaviour = Infallible;
    type InboundProtocol = Upgrade;
    type OutboundProtocol = Upgrade;
    type InboundOpenInfo = ();
    type OutboundOpenInfo = StreamReply;

    fn listen_protocol(&self) -> SubstreamProtocol<Upgrade, ()> {
        let protocols = if self.accepting() {
            vec![self.protocol.clone()]
        } else {
            vec![]
        };
        SubstreamProtocol::new(Upgrade { protocols }, ())
    }

    /// Kept open while streams are asked for; open streams keep the connection alive by themselves.
    fn connection_keep_alive(&self) -> bool {
        !self.requested.is_empty()
    }

    fn poll(
        &mut self,
        _: &mut Context<'_>,
    ) -> Poll<ConnectionHandlerEvent<Upgrade, StreamReply, Infallible>> {
        match self.requested.pop_front() {
            Some(reply) => Poll::Ready(ConnectionHandlerEvent::OutboundSubstreamRequest {
                protocol: SubstreamProtocol::new(
                    Upgrade {
                        protocols: vec![self.protocol.clone()],
                    },
                    reply,
                ),
            }),
            None => Poll::Pending,
        }
    }

    fn on_behaviour_event(&mut self, reply: StreamReply) {
        self.requested.push_back(reply);
    }

    fn on_connection_event(&mut self, event: ConnectionEvent<Upgrade, Upgrade, (), StreamReply>) {
        match event {
            ConnectionEvent::FullyNegotiatedInbound(FullyNegotiatedInbound {
                protocol: stream,
                ..
            }) => {
                let remote = self.remote;
                let acceptor = self.acceptor.lock().unwrap_or_else(|e| e.into_inner());
                let Some(acceptor) = acceptor.as_ref() else {
                    tracing::debug!(peer = %remote, "no acceptor; resetting an inbound stream");
                    return;
                };
                match acceptor.try_send((remote, stream)) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => {
                        tracing::warn!(peer = %remote, backlog = super::ACCEPT_BACKLOG, "accept backlog full; resetting an inbound stream")
                    }
                    Err(TrySendError::Closed(_)) => {
                        tracing::debug!(peer = %remote, "no acceptor; resetting an inbound stream")
                    }
                }
            }
            ConnectionEvent::FullyNegotiatedOutbound(FullyNegotiatedOutbound {
                protocol: stream,
                info: reply,
            }) => {
                let _ = reply.send(Ok(stream));
            }
            ConnectionEvent::DialUpgradeError(DialUpgradeError { info: reply, error }) => {
                let error = match error {
                    StreamUpgradeError::Timeout => OpenStreamError::Timeout,
                    StreamUpgradeError::NegotiationFailed => {
                        OpenStreamError::UnsupportedProtocol(self.protocol.clone())
                    }
                    StreamUpgradeError::Io(e) => OpenStreamError::Io(e),
                    StreamUpgradeError::Apply(never) => match never {},
                };
                let _ = reply.send(Err(error));
            }
            _ => {}
        }
    }
}

//! Raw inference streams: one libp2p protocol whose streams the node and the client frame themselves.
//!
//! Why not `libp2p-stream`: it hands inbound streams to the acceptor through a rendezvous channel and drops any
//! stream that arrives while the previous one is still being handed over, so two sessions opened at the same
//! moment (two API users, a batch of sessions from one client) lost one of them to a reset that reads as
//! "connection is closed" on the client. Here inbound streams wait in a backlog of [`ACCEPT_BACKLOG`] like a TCP
//! listen queue, outbound opens on one connection are negotiated side by side rather than one at a time, and a
//! stream prefers a direct connection over a relayed one.
mod handler;
mod upgrade;

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use libp2p::{
    core::{transport::PortUse, Endpoint},
    swarm::{
        behaviour::ConnectionEstablished, ConnectionClosed, ConnectionDenied, ConnectionId,
        FromSwarm, NetworkBehaviour, NotifyHandler, THandler, THandlerInEvent, THandlerOutEvent,
        ToSwarm,
    },
    Multiaddr, PeerId, Stream, StreamProtocol,
};
use tokio::sync::{mpsc, oneshot};

use handler::Handler;

/// Inbound streams that may wait for the acceptor. A burst bigger than this is an overload (the acceptor only
/// spawns a task per stream), and the streams beyond it are reset.
pub const ACCEPT_BACKLOG: usize = 256;

/// Why an outbound stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenStreamError {
    #[error("not connected")]
    NotConnected,
    #[error("peer does not serve {0}")]
    UnsupportedProtocol(StreamProtocol),
    #[error("negotiating the stream timed out")]
    Timeout,
    #[error("connection closed while opening the stream")]
    ConnectionClosed,
    #[error("{0}")]
    Io(std::io::Error),
}

type StreamReply = oneshot::Sender<Result<Stream, OpenStreamError>>;

/// The acceptor's side of the backlog, shared with every connection handler.
type Acceptor = Arc<Mutex<Option<mpsc::Sender<(PeerId, Stream)>>>>;

struct OpenRequest {
    peer: PeerId,
    reply: StreamReply,
}

/// The inference-stream protocol as a [`NetworkBehaviour`]: opens outbound streams for [`Control`] and queues
/// inbound ones for [`IncomingStreams`].
pub struct Behaviour {
    protocol: StreamProtocol,
    acceptor: Acceptor,
    requests: mpsc::UnboundedReceiver<OpenRequest>,
    control: Control,
    /// Open connections: peer and whether the connection goes through a relay.
    connections: HashMap<ConnectionId, (PeerId, bool)>,
    pending: VecDeque<ToSwarm<(), StreamReply>>,
}

impl Behaviour {
    pub fn new(protocol: StreamProtocol) -> Self {
        let (sender, requests) = mpsc::unbounded_channel();
        let acceptor: Acceptor = Arc::default();
        Self {
            control: Control {
                requests: sender,
                acceptor: acceptor.clone(),
            },
            protocol,
            acceptor,
            requests,
            connections: HashMap::new(),
            pending: VecDeque::new(),
        }
    }

    pub fn control(&self) -> Control {
        self.control.clone()
    }

    /// The connection a new stream to `peer` goes on: a direct one if there is any, and the newest of those (an
    /// older one is the likelier to sit behind an expired NAT mapping).
    fn pick_connection(&self, peer: PeerId) -> Option<ConnectionId> {
        self.connections
            .iter()
            .filter(|(_, (p, _))| *p == peer)
            .max_by_key(|(id, (_, relayed))| (!*relayed, **id))
            .map(|(id, _)| *id)
    }

    fn handler(&self, remote: PeerId) -> Handler {
        Handler::new(self.protocol.clone(), self.acceptor.clone(), remote)
    }
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = Handler;
    type ToSwarm = ();

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(self.handler(peer))
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(self.handler(peer))
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            }) => {
                let relayed = endpoint.is_relayed();
                self.connections.insert(connection_id, (peer_id, relayed));
            }
            FromSwarm::ConnectionClosed(ConnectionClosed { connection_id, .. }) => {
                self.connections.remove(&connection_id);
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<ToSwarm<(), THandlerInEvent<Self>>> {
        while let Poll::Ready(Some(OpenRequest { peer, reply })) = self.requests.poll_recv(cx) {
            match self.pick_connection(peer) {
                Some(connection) => self.pending.push_back(ToSwarm::NotifyHandler {
                    peer_id: peer,
                    handler: NotifyHandler::One(connection),
                    event: reply,
                }),
                None => {
                    let _ = reply.send(Err(OpenStreamError::NotConnected));
                }
            }
        }
        match self.pending.pop_front() {
            Some(event) => Poll::Ready(event),
            None => Poll::Pending,
        }
    }
}

/// Opens streams and registers the acceptor. Cheap to clone.
#[derive(Clone)]
pub struct Control {
    requests: mpsc::UnboundedSender<OpenRequest>,
    acceptor: Acceptor,
}

impl Control {
    /// Opens a stream to `peer` on an existing connection (dialing is the actor's job).
    pub async fn open_stream(&self, peer: PeerId) -> Result<Stream, OpenStreamError> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .send(OpenRequest { peer, reply })
            .map_err(|_| OpenStreamError::ConnectionClosed)?;
        answer
            .await
            .unwrap_or(Err(OpenStreamError::ConnectionClosed))
    }

    /// Starts accepting inbound streams; `None` while another acceptor is alive. Until the first call, peers are
    /// told the protocol is not supported.
    pub fn accept(&self) -> Option<IncomingStreams> {
        let mut acceptor = self.acceptor.lock().unwrap_or_else(|e| e.into_inner());
        if acceptor.as_ref().is_some_and(|s| !s.is_closed()) {
            return None;
        }
        let (sender, receiver) = mpsc::channel(ACCEPT_BACKLOG);
        *acceptor = Some(sender);
        Some(IncomingStreams { receiver })
    }
}

/// Inbound streams with the peer that opened each. Dropping it stops accepting (and allows a new acceptor).
pub struct IncomingStreams {
    receiver: mpsc::Receiver<(PeerId, Stream)>,
}

impl futures::Stream for IncomingStreams {
    type Item = (PeerId, Stream);

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.receiver.poll_recv(cx)
    }
}

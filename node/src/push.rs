//! Server-to-server push: a client's step goes to the first server of its route, and each server forwards its
//! output straight to the next, so a token crosses k + 1 links instead of 2k. Every server still answers the client
//! (with its output, and, for a pushed step, the input it was pushed), so the client keeps what it needs to replay.
//!
//! - [`PushInbox`]: hidden states pushed to this node's sessions, matched to the step waiting for them (`Step` with
//!   `await_push`), whichever of the two arrives first. A push must carry the session's push token, a random
//!   capability the node gives only to the client that opened the session.
//! - [`Pusher`]: sends this node's outputs to the next servers, one task and one stream per next server, in order,
//!   without waiting for answers.
use petal_p2p::{Multiaddr, Network, PeerId, Stream};
use petal_proto::pb::{self, request, response};
use petal_proto::FramedStream;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Bytes of a push token.
pub const TOKEN_BYTES: usize = 16;
/// Pushes queued for one next server before more are dropped (their steps then time out and the client drives them).
const QUEUE: usize = 64;
/// Bound on one push's delivery (stream opening included).
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a pushed step got no input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AwaitError {
    /// Nothing came within the wait.
    Timeout,
    /// The session is not registered (closed meanwhile).
    Unknown,
}

struct Slot {
    token: [u8; TOKEN_BYTES],
    /// A step waiting for position `.0`'s input.
    waiting: Option<(u32, oneshot::Sender<pb::Tensor>)>,
    /// Input that came before its step asked (the client's step and the previous server's push race).
    early: Option<(u32, pb::Tensor)>,
}

/// Pushed inputs of this node's sessions, by session id.
#[derive(Default)]
pub struct PushInbox {
    slots: Mutex<HashMap<u64, Slot>>,
}

/// Keeps a session in the inbox; dropping it (the session closes) removes the session and anything pushed to it.
pub struct Registration {
    inbox: Arc<PushInbox>,
    session_id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.inbox.lock().remove(&self.session_id);
    }
}

impl PushInbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Lets pushes carrying `token` reach `session_id` for as long as the registration lives.
    pub fn register(self: &Arc<Self>, session_id: u64, token: [u8; TOKEN_BYTES]) -> Registration {
        self.lock().insert(
            session_id,
            Slot {
                token,
                waiting: None,
                early: None,
            },
        );
        Registration {
            inbox: self.clone(),
            session_id,
        }
    }

    /// Delivers a push: to the step waiting for it, or kept until that step asks (one per session: a newer push
    /// replaces an unclaimed older one, whose step has been driven otherwise). `false`: no session has this id and
    /// token.
    pub fn deliver(
        &self,
        session_id: u64,
        token: &[u8],
        position: u32,
        hidden: pb::Tensor,
    ) -> bool {
        let mut slots = self.lock();
        let Some(slot) = slots.get_mut(&session_id) else {
            return false;
        };
        if slot.token.as_slice() != token {
            return false;
        }
        match slot.waiting.take() {
            Some((wanted, reply)) if wanted == position => {
                // The waiting step may have given up this instant: keep the input for a retry of it then.
                if let Err(hidden) = reply.send(hidden) {
                    slot.early = Some((position, hidden));
                }
            }
            waiting => {
                slot.waiting = waiting;
                slot.early = Some((position, hidden));
            }
        }
        true
    }

    /// The input pushed for `session_id` at `position`, waiting at most `wait` for it.
    pub async fn take(
        &self,
        session_id: u64,
        position: u32,
        wait: Duration,
    ) -> Result<pb::Tensor, AwaitError> {
        let receiver = {
            let mut slots = self.lock();
            let slot = slots.get_mut(&session_id).ok_or(AwaitError::Unknown)?;
            match slot.early.take() {
                Some((p, hidden)) if p == position => return Ok(hidden),
                // An input for another position is stale (older) or not ours to use yet (newer): keep a newer one.
                Some((p, hidden)) if p > position => slot.early = Some((p, hidden)),
                _ => {}
            }
            let (reply, receiver) = oneshot::channel();
            slot.waiting = Some((position, reply));
            receiver
        };
        match tokio::time::timeout(wait, receiver).await {
            Ok(Ok(hidden)) => Ok(hidden),
            Ok(Err(_)) => Err(AwaitError::Unknown),
            Err(_) => {
                if let Some(slot) = self.lock().get_mut(&session_id) {
                    slot.waiting = None;
                }
                Err(AwaitError::Timeout)
            }
        }
    }
}

/// Sends outputs on to the next servers of their routes. Cheap to clone.
#[derive(Clone)]
pub struct Pusher {
    net: Network,
    max_frame_bytes: usize,
    /// One queue (and task, and stream) per next server.
    links: Arc<Mutex<HashMap<PeerId, mpsc::Sender<pb::Push>>>>,
}

impl Pusher {
    pub fn new(net: Network, max_frame_bytes: usize) -> Self {
        Self {
            net,
            max_frame_bytes,
            links: Arc::default(),
        }
    }

    /// Queues `hidden` (the output at `position`) for `target`; never waits. A push that cannot be queued or
    /// delivered is dropped with a log line: the next server's step then times out and its client drives it.
    pub fn push(&self, target: &pb::PushTarget, position: u32, hidden: pb::Tensor) {
        let Ok(peer) = target.peer_id.parse::<PeerId>() else {
            tracing::debug!(peer = %target.peer_id, "push target with an invalid peer id");
            return;
        };
        let push = pb::Push {
            session_id: target.session_id,
            push_token: target.push_token.clone(),
            position,
            hidden: Some(hidden),
            unanswered: true,
        };
        let mut links = self
            .links
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let queue = links
            .entry(peer)
            .or_insert_with(|| self.spawn_link(peer, target));
        let push = match queue.try_send(push) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::debug!(%peer, "push queue full; dropping");
                return;
            }
            // The link's task ended (its stream broke): start another.
            Err(mpsc::error::TrySendError::Closed(push)) => push,
        };
        let queue = self.spawn_link(peer, target);
        let _ = queue.try_send(push);
        links.insert(peer, queue);
    }

    fn spawn_link(&self, peer: PeerId, target: &pb::PushTarget) -> mpsc::Sender<pb::Push> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let addrs: Vec<Multiaddr> = target.addrs.iter().filter_map(|a| a.parse().ok()).collect();
        tokio::spawn(run_link(
            self.net.clone(),
            peer,
            addrs,
            self.max_frame_bytes,
            rx,
        ));
        tx
    }
}

/// One next server's link: its pushes in order over one stream, back to back (sent `unanswered`). Whatever comes
/// back (answers from a server that predates `unanswered`) is read and dropped, so it never fills the stream's
/// window. Ends at the first failure (the pending pushes are dropped; their steps time out and are driven by their
/// clients).
async fn run_link(
    net: Network,
    peer: PeerId,
    addrs: Vec<Multiaddr>,
    max_frame_bytes: usize,
    mut queue: mpsc::Receiver<pb::Push>,
) {
    if !addrs.is_empty() {
        net.add_addresses(peer, addrs).await;
    }
    let mut stream: Option<FramedStream<Stream>> = None;
    loop {
        let push = match stream.as_mut() {
            None => queue.recv().await,
            // `recv` keeps a partly read answer in the stream, so choosing the queue cancels nothing.
            Some(s) => tokio::select! {
                push = queue.recv() => push,
                answer = s.recv::<pb::Response>() => match answer {
                    Ok(Some(pb::Response { kind: Some(response::Kind::Error(e)) })) => {
                        tracing::debug!(%peer, code = e.code, message = %e.message, "push refused");
                        continue;
                    }
                    Ok(Some(_)) => continue,
                    Ok(None) => {
                        tracing::info!(%peer, "the next server closed the push stream; its clients will drive the step");
                        return;
                    }
                    Err(e) => {
                        tracing::info!(%peer, error = %e, "pushing to the next server failed; its clients will drive the step");
                        return;
                    }
                },
            },
        };
        let Some(push) = push else {
            return;
        };
        let sent = tokio::time::timeout(SEND_TIMEOUT, async {
            if stream.is_none() {
                let s = net.open_stream(peer).await.map_err(|e| e.to_string())?;
                stream = Some(FramedStream::new(s, max_frame_bytes));
            }
            let Some(s) = stream.as_mut() else {
                return Err("no stream".to_string());
            };
            tracing::trace!("pushing to the next server");
            s.send(&pb::Request {
                kind: Some(request::Kind::Push(push)),
            })
            .await
            .map_err(|e| e.to_string())?;
            tracing::trace!("pushed to the next server");
            Ok(())
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::info!(%peer, error = %e, "pushing to the next server failed; its clients will drive the step");
                return;
            }
            Err(_) => {
                tracing::info!(%peer, "pushing to the next server timed out; its clients will drive the step");
                return;
            }
        }
    }
}

/// A fresh random push token.
pub fn new_token() -> [u8; TOKEN_BYTES] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(v: u8) -> pb::Tensor {
        pb::Tensor {
            data: vec![v],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_push_meets_its_step_whichever_comes_first() {
        let inbox = Arc::new(PushInbox::default());
        let token = new_token();
        let _session = inbox.register(7, token);
        // Push first, then the step.
        assert!(inbox.deliver(7, &token, 0, tensor(1)));
        let got = inbox.take(7, 0, Duration::from_secs(1)).await;
        assert_eq!(got.map(|t| t.data), Ok(vec![1]));
        // Step first, then the push.
        let (got, delivered) = tokio::join!(inbox.take(7, 1, Duration::from_secs(5)), async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            inbox.deliver(7, &token, 1, tensor(2))
        });
        assert!(delivered);
        assert_eq!(got.map(|t| t.data), Ok(vec![2]));
    }

    #[tokio::test]
    async fn wrong_tokens_stale_inputs_and_closed_sessions_are_refused() {
        let inbox = Arc::new(PushInbox::default());
        let token = new_token();
        let session = inbox.register(7, token);
        assert!(!inbox.deliver(7, &new_token(), 0, tensor(1)), "wrong token");
        assert!(!inbox.deliver(8, &token, 0, tensor(1)), "unknown session");
        // An input for an older position is not taken for a newer one.
        assert!(inbox.deliver(7, &token, 3, tensor(3)));
        let got = inbox.take(7, 4, Duration::from_millis(50)).await;
        assert_eq!(got.map(|t| t.data), Err(AwaitError::Timeout));
        drop(session);
        assert!(!inbox.deliver(7, &token, 4, tensor(4)), "closed session");
        let got = inbox.take(7, 4, Duration::from_millis(50)).await;
        assert_eq!(got.map(|t| t.data), Err(AwaitError::Unknown));
    }
}

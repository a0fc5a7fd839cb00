//! Server-to-server push between real swarms on loopback, from the sending side.
mod common;

use common::loopback_network;
use futures::StreamExt;
use petal_node::push::{new_token, Pusher};
use petal_proto::pb::{self, request, response};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES};
use std::time::Duration;
use tokio::sync::mpsc;

/// A server that predates `unanswered` answers every push, some with a refusal: the link reads and drops
/// those answers and keeps delivering, in order, over real swarms on loopback.
#[tokio::test]
async fn answers_from_a_server_that_predates_unanswered_pushes_are_read_and_dropped() {
    const PUSHES: u32 = 200;
    let (old_server, sender) = (loopback_network().await, loopback_network().await);
    let mut incoming = old_server.accept_streams().expect("accepting");
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some((_, stream)) = incoming.next().await {
            let seen_tx = seen_tx.clone();
            tokio::spawn(async move {
                let mut framed = FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES);
                while let Ok(Some(req)) = framed.recv::<pb::Request>().await {
                    let Some(request::Kind::Push(push)) = req.kind else {
                        panic!("not a push: {req:?}");
                    };
                    assert!(push.unanswered, "pushes are sent unanswered");
                    // Answered all the same, as before the field; every third refused.
                    let kind = if push.position % 3 == 0 {
                        response::Kind::Error(pb::Error::default())
                    } else {
                        response::Kind::Pushed(pb::Pushed {
                            session_id: push.session_id,
                            position: push.position,
                        })
                    };
                    let answer = pb::Response { kind: Some(kind) };
                    if framed.send(&answer).await.is_err() {
                        return;
                    }
                    let _ = seen_tx.send(push.position);
                }
            });
        }
    });
    let pusher = Pusher::new(sender.clone(), DEFAULT_MAX_FRAME_BYTES);
    let target = pb::PushTarget {
        peer_id: old_server.peer_id().to_string(),
        addrs: old_server
            .listen_addrs()
            .await
            .iter()
            .map(ToString::to_string)
            .collect(),
        session_id: 7,
        push_token: new_token().to_vec(),
    };
    let within = Duration::from_secs(20);
    for position in 0..PUSHES {
        let hidden = pb::Tensor {
            data: vec![1],
            ..Default::default()
        };
        pusher.push(&target, position, hidden);
        let got = tokio::time::timeout(within, seen.recv()).await;
        assert_eq!(
            got,
            Ok(Some(position)),
            "push {position} not delivered in order"
        );
    }
    sender.shutdown().await;
    old_server.shutdown().await;
}

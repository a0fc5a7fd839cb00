//! Keeps a server's [`ServerRecord`] fresh in the DHT.
//!
//! A small actor: it provides [`model_key`] and [`SERVERS_KEY`], puts the record under [`server_key`] at once,
//! then again every ttl/3 (so two refreshes can be lost before the record expires) and soon after the record
//! changes (free cache, open sessions), rate-limited so a busy server does not flood the DHT. On shutdown,
//! [`AnnouncerHandle::withdraw`] publishes the record with `withdrawn = true` so clients drop the server at once
//! instead of after the TTL.

use std::time::Duration;

use petal_proto::pb::ServerRecord;
use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
    time::Instant,
};

use crate::{
    records::{model_key, now_unix_ms, server_key, SERVERS_KEY},
    NetError, Network,
};

/// Bound on [`AnnouncerHandle::withdraw`]: shutdown must not hang on an unreachable DHT.
pub const WITHDRAW_TIMEOUT: Duration = Duration::from_secs(10);
/// Shortest refresh period, whatever the TTL.
const MIN_PERIOD: Duration = Duration::from_millis(100);
/// Upper bound on the delay between a record change and its publication.
const MAX_CHANGE_DELAY: Duration = Duration::from_secs(2);

/// Spawns announcers; see [`Announcer::spawn`].
pub struct Announcer;

enum Request {
    Withdraw(oneshot::Sender<Result<(), NetError>>),
}

/// Controls a running announcer. Dropping it stops the announcements without withdrawing: the record then
/// expires from the DHT within one TTL.
#[must_use = "dropping the handle stops announcing"]
pub struct AnnouncerHandle {
    messages: mpsc::Sender<Request>,
    task: JoinHandle<()>,
    /// Publications done so far (0 until the first one ended).
    published: watch::Receiver<u64>,
}

impl Announcer {
    /// Starts announcing the current value of `record_source`, which the server updates as its state changes.
    ///
    /// Before each publication the announcer sets `peer_id` to this node's id, `updated_unix_ms` to now and
    /// `ttl_ms` to `ttl`; it fills `addrs` with the network's listen addresses and `record_version` with
    /// [`petal_proto::RECORD_VERSION`] when they are empty. `ttl` should equal the network's
    /// `NetConfig::record_ttl` (the DHT keeps records no longer than that anyway).
    pub fn spawn(
        network: Network,
        record_source: watch::Receiver<ServerRecord>,
        ttl: Duration,
    ) -> AnnouncerHandle {
        let (messages, inbox) = mpsc::channel(4);
        let (published_tx, published) = watch::channel(0);
        let task = tokio::spawn(run(network, record_source, ttl, inbox, published_tx));
        AnnouncerHandle {
            messages,
            task,
            published,
        }
    }
}

impl AnnouncerHandle {
    /// Publishes the record with `withdrawn = true`, stops providing the keys and ends the announcer. Meant for
    /// SIGTERM/SIGINT handling; bounded by [`WITHDRAW_TIMEOUT`]. Calling it again returns [`NetError::Closed`].
    pub async fn withdraw(&self) -> Result<(), NetError> {
        let (reply, answer) = oneshot::channel();
        self.messages
            .send(Request::Withdraw(reply))
            .await
            .map_err(|_| NetError::Closed)?;
        tokio::time::timeout(WITHDRAW_TIMEOUT, answer)
            .await
            .map_err(|_| NetError::Timeout("withdrawing the server record"))?
            .map_err(|_| NetError::Closed)?
    }

    /// Waits (at most `timeout`) until the first publication has been attempted, so a server that says it is
    /// serving can be found. `false` if that took longer.
    pub async fn first_published(&self, timeout: Duration) -> bool {
        let mut published = self.published.clone();
        tokio::time::timeout(timeout, published.wait_for(|n| *n > 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Whether the announcer task has ended (withdrawn, or its network shut down).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for AnnouncerHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// State of the announcer task between publications.
struct State {
    network: Network,
    ttl: Duration,
    /// Model id currently provided, if its provider announcement succeeded.
    provided_model: Option<String>,
}

impl State {
    /// Stamps and signs `record` for publication.
    async fn stamp(&self, mut record: ServerRecord, withdrawn: bool) -> Result<Vec<u8>, NetError> {
        record.peer_id = self.network.peer_id().to_string();
        if record.addrs.is_empty() {
            record.addrs = crate::reachability::announceable(self.network.listen_addrs().await)
                .iter()
                .map(ToString::to_string)
                .collect();
        }
        if record.record_version == 0 {
            record.record_version = petal_proto::RECORD_VERSION;
        }
        record.updated_unix_ms = now_unix_ms();
        record.ttl_ms = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        record.withdrawn = withdrawn;
        self.network.sign_record(&record)
    }

    /// Puts the record and (re)announces the provider keys that are not announced yet. Failures are logged and
    /// retried at the next period: a lone first server has nobody to store at, which is fine.
    ///
    /// Returns `Err(NetError::Closed)` only when the network is gone, which ends the announcer.
    async fn publish(&mut self, record: ServerRecord) -> Result<(), NetError> {
        let model_id = record.model_id.clone();
        let value = self.stamp(record, false).await?;
        let key = server_key(&self.network.peer_id());
        match self.network.put_record(key, value, self.ttl).await {
            Ok(()) => {}
            Err(NetError::Closed) => return Err(NetError::Closed),
            Err(e) => tracing::warn!(error = %e, "cannot publish server record; will retry"),
        }

        // Provider records are announced again at every publication, not only once: each carries the addresses
        // this node has *at that moment*, and a node behind NAT gains its relayed addresses only after its first
        // announcement. Peers drop a provider whose record has no address and who is not in their routing table.
        if self.provided_model.as_deref() != Some(model_id.as_str()) {
            if let Some(old) = self.provided_model.take() {
                self.network.stop_providing(model_key(&old)).await;
            }
        }
        match self.network.start_providing(model_key(&model_id)).await {
            Ok(()) => self.provided_model = Some(model_id),
            Err(NetError::Closed) => return Err(NetError::Closed),
            Err(e) => tracing::warn!(error = %e, %model_id, "cannot announce model; will retry"),
        }
        match self.network.start_providing(SERVERS_KEY.to_vec()).await {
            Ok(()) => {}
            Err(NetError::Closed) => return Err(NetError::Closed),
            Err(e) => tracing::warn!(error = %e, "cannot announce server; will retry"),
        }
        Ok(())
    }

    async fn withdraw(&mut self, record: ServerRecord) -> Result<(), NetError> {
        let model_id = record.model_id.clone();
        self.network.stop_providing(model_key(&model_id)).await;
        if let Some(old) = self.provided_model.take().filter(|old| *old != model_id) {
            self.network.stop_providing(model_key(&old)).await;
        }
        self.network.stop_providing(SERVERS_KEY.to_vec()).await;
        let value = self.stamp(record, true).await?;
        let key = server_key(&self.network.peer_id());
        self.network.put_record(key, value, self.ttl).await?;
        tracing::info!("server record withdrawn");
        Ok(())
    }
}

async fn run(
    network: Network,
    mut source: watch::Receiver<ServerRecord>,
    ttl: Duration,
    mut inbox: mpsc::Receiver<Request>,
    published: watch::Sender<u64>,
) {
    let period = (ttl / 3).max(MIN_PERIOD);
    // Changes are published at most this often; periodic refreshes carry later changes anyway.
    let change_gap = (ttl / 10).clamp(MIN_PERIOD, MAX_CHANGE_DELAY);
    let mut state = State {
        network,
        ttl,
        provided_model: None,
    };
    // Provider records carry the addresses this node has when they are made, and a peer drops a provider it has
    // neither addresses for nor in its routing table: so the first announcement waits (briefly) until AutoNAT has
    // spoken and, behind NAT, a relay holds a slot (its circuit address is then an external address).
    wait_until_reachable(&state.network, FIRST_ANNOUNCE_DEADLINE).await;
    let mut watching = true;
    let mut last_publish: Option<Instant> = None;
    let mut next = Instant::now();
    loop {
        tokio::select! {
            message = inbox.recv() => {
                // `None`: the handle was dropped; the task is being aborted anyway.
                if let Some(Request::Withdraw(reply)) = message {
                    let record = source.borrow().clone();
                    let _ = reply.send(state.withdraw(record).await);
                }
                return;
            }
            changed = source.changed(), if watching => {
                match changed {
                    Ok(()) => {
                        let soonest = last_publish.map_or_else(Instant::now, |t| t + change_gap);
                        next = next.min(soonest);
                    }
                    // The server dropped the sender: keep refreshing the last value.
                    Err(_) => watching = false,
                }
            }
            () = tokio::time::sleep_until(next) => {
                let record = source.borrow_and_update().clone();
                // A withdrawal must not wait behind a slow publication.
                tokio::select! {
                    result = state.publish(record) => {
                        if result.is_err() {
                            tracing::debug!("network stopped; announcer exits");
                            return;
                        }
                    }
                    message = inbox.recv() => {
                        if let Some(Request::Withdraw(reply)) = message {
                            let record = source.borrow().clone();
                            let _ = reply.send(state.withdraw(record).await);
                        }
                        return;
                    }
                }
                let now = Instant::now();
                last_publish = Some(now);
                next = now + period;
                published.send_modify(|n| *n += 1);
            }
        }
    }
}

/// How long the first announcement waits for reachability to be known (a lone first node never learns it).
const FIRST_ANNOUNCE_DEADLINE: Duration = Duration::from_secs(8);

/// Waits until this node is known to be public, or private with a relayed address, or `limit` passes.
async fn wait_until_reachable(network: &Network, limit: Duration) {
    let mut reachability = network.reachability();
    let known = reachability.wait_for(|r| match r.status {
        crate::NatStatus::Public => true,
        crate::NatStatus::Private => !r.relayed.is_empty(),
        crate::NatStatus::Unknown => false,
    });
    if tokio::time::timeout(limit, known).await.is_err() {
        tracing::debug!("reachability still unknown; announcing anyway");
    }
}

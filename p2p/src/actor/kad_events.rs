//! Kademlia query progress: answering the callers of puts, lookups and bootstraps.
use libp2p::{kad, PeerId};
use std::collections::HashSet;

use super::Actor;
use crate::NetError;

impl Actor {
    pub(super) fn on_kad_event(&mut self, event: kad::Event) {
        let (id, result, step) = match event {
            kad::Event::OutboundQueryProgressed {
                id, result, step, ..
            } => (id, result, step),
            kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::PutRecord {
                        source,
                        record: Some(record),
                        ..
                    },
            } => return self.on_inbound_put(source, record),
            kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::AddProvider {
                        record: Some(record),
                    },
            } => return self.on_inbound_provider(record),
            event => {
                tracing::trace!(?event, "kademlia event");
                return;
            }
        };
        match result {
            kad::QueryResult::PutRecord(result) => {
                if let Some(pending) = self.puts.remove(&id) {
                    let result = match result {
                        Ok(_) => Ok(()),
                        Err(e) if !pending.had_peers => {
                            tracing::debug!(error = %e, "record stored locally only: no peers yet");
                            Ok(())
                        }
                        Err(e) => Err(NetError::Dht(format!("put_record: {e}"))),
                    };
                    let _ = pending.reply.send(result);
                }
            }
            kad::QueryResult::StartProviding(result) => {
                if let Some(pending) = self.providing.remove(&id) {
                    let result = match result {
                        Ok(_) => Ok(()),
                        Err(e) if !pending.had_peers => {
                            tracing::debug!(error = %e, "providing locally only: no peers yet");
                            Ok(())
                        }
                        Err(e) => Err(NetError::Dht(format!("start_providing: {e}"))),
                    };
                    let _ = pending.reply.send(result);
                }
            }
            kad::QueryResult::GetRecord(result) => {
                if let Some(lookup) = self.record_lookups.get_mut(&id) {
                    match result {
                        Ok(kad::GetRecordOk::FoundRecord(found)) => {
                            if lookup.seen.insert(found.record.value.clone()) {
                                // A closed receiver means the caller gave up; the cancel command follows.
                                let _ = lookup.found.send(found.record.value);
                            }
                        }
                        Ok(kad::GetRecordOk::FinishedWithNoAdditionalRecord { .. }) => {}
                        Err(e) => tracing::debug!(error = %e, "get_record ended"),
                    }
                    if step.last {
                        self.record_lookups.remove(&id);
                    }
                }
            }
            kad::QueryResult::GetProviders(result) => {
                if let Some(lookup) = self.provider_lookups.get_mut(&id) {
                    match result {
                        Ok(kad::GetProvidersOk::FoundProviders { providers, .. }) => {
                            let new: HashSet<PeerId> = providers
                                .into_iter()
                                .filter(|p| lookup.seen.insert(*p))
                                .collect();
                            if !new.is_empty() {
                                let _ = lookup.found.send(new);
                            }
                        }
                        Ok(kad::GetProvidersOk::FinishedWithNoAdditionalRecord { .. }) => {}
                        Err(e) => tracing::debug!(error = %e, "get_providers ended"),
                    }
                    if step.last {
                        self.provider_lookups.remove(&id);
                    }
                }
            }
            kad::QueryResult::Bootstrap(result) => {
                // The caller is answered after the first step, the lookup of our own id, which fills the routing
                // table with our neighbours; the bucket refreshes after it go on in the background. Waiting for
                // them too would make the caller wait out an unreachable bootstrap peer's handshake once per
                // refresh, since maintenance keeps re-adding bootstrap peers to the table.
                if step.count.get() == 1 || step.last {
                    if let Some(reply) = self.bootstraps.remove(&id) {
                        let result = match result {
                            Ok(_) if self.swarm.connected_peers().next().is_some() => Ok(()),
                            Ok(_) => Err(NetError::Dht("no bootstrap peer reachable".into())),
                            Err(e) => Err(NetError::Dht(format!("bootstrap: {e}"))),
                        };
                        let _ = reply.send(result);
                    }
                }
            }
            other => tracing::trace!(?other, "kademlia query progressed"),
        }
    }
}

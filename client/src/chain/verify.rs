//! Checking a hop's answers on other servers ([`crate::verification`] has the policy, the comparison and the
//! majority rule). Once a hop's step is first drawn for a check, a second chain over the same blocks on other
//! servers (its shadow) is opened and sent the hop's whole history, then every later input of the hop, step by step
//! as the hop got them (the same chunking gives the same numerics: honest CPU servers agree bit for bit). The
//! shadow runs in a task of its own, alongside the chain, so the client waits for it only on the steps drawn for a
//! check. On a mismatch, a third chain on yet other servers decides: a server outvoted by two that agree is banned
//! for the longest time, and if it was the hop's, the chain that outvoted it takes its place (it holds the same
//! history) and its answer is used.
use super::{run_recorded, ChainConfig, ChainLink, ChainSession, Failover};
use crate::error::{ClientError, Result};
use crate::verification::{deviation, judge, Mismatch, Numerics, Opinions, Verdict};
use candle_core::Tensor;
use petal_proto::pb;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// How long a hop whose blocks no other server holds goes unchecked before the swarm is looked at again.
pub(super) const RECHECK_AFTER: Duration = Duration::from_secs(30);

/// A failure of a checking chain: which of its links failed, and how.
type LinkFailure = (usize, ClientError);

/// What a shadow's task is asked to do, in order.
enum Command {
    /// Run the step at `position` (a hop's recorded input); answer with its output when `answer` is set.
    Step {
        position: u32,
        input: pb::Tensor,
        answer: Option<oneshot::Sender<std::result::Result<Tensor, LinkFailure>>>,
    },
    /// Hand the links back (the chain takes them over), after every step sent before.
    Surrender(oneshot::Sender<Vec<ChainLink>>),
}

/// A second (or third) chain over one hop's blocks, on other servers, fed the hop's inputs in a task of its own.
/// Dropping it ends the task and closes its streams; its servers free the sessions.
pub(super) struct Shadow {
    commands: mpsc::UnboundedSender<Command>,
    peers: Vec<String>,
    numerics: Numerics,
    /// Bytes its links sent and received, kept up to date by its task.
    bytes: Arc<AtomicU64>,
}

impl Shadow {
    /// Starts the task running `links`, and sends it `history`.
    fn start(links: Vec<ChainLink>, history: &[(u32, pb::Tensor)], config: &ChainConfig) -> Self {
        let peers = links
            .iter()
            .map(|l| l.hop.hop().peer_id().to_string())
            .collect();
        let numerics = links
            .iter()
            .map(ChainLink::numerics)
            .fold(Numerics::default(), |all, n| all.join(&n));
        let bytes = Arc::new(AtomicU64::new(0));
        let (commands, inbox) = mpsc::unbounded_channel();
        tokio::spawn(run(links, inbox, config.clone(), bytes.clone()));
        let shadow = Self {
            commands,
            peers,
            numerics,
            bytes,
        };
        for (position, input) in history {
            shadow.feed(*position, input.clone());
        }
        shadow
    }

    pub(super) fn bytes_on_wire(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Sends it the hop's next input, without waiting.
    fn feed(&self, position: u32, input: pb::Tensor) {
        // A send fails only when the task ended, after a failure it reports at the next check.
        let _ = self.commands.send(Command::Step {
            position,
            input,
            answer: None,
        });
    }

    /// Sends it the hop's next input and waits for its answer (after every step sent before).
    async fn answer(
        &self,
        position: u32,
        input: pb::Tensor,
    ) -> std::result::Result<Tensor, LinkFailure> {
        let (tx, rx) = oneshot::channel();
        let gone = || {
            (
                0,
                ClientError::Request("the checking chain's task ended".into()),
            )
        };
        self.commands
            .send(Command::Step {
                position,
                input,
                answer: Some(tx),
            })
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Its links, once it has run everything sent to it.
    async fn surrender(self) -> Option<Vec<ChainLink>> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Surrender(tx)).ok()?;
        rx.await.ok()
    }
}

/// A shadow's task: runs each step through the links in order. After a failure it runs nothing more and answers
/// every request with that failure (the chain then drops it).
async fn run(
    mut links: Vec<ChainLink>,
    mut inbox: mpsc::UnboundedReceiver<Command>,
    config: ChainConfig,
    bytes: Arc<AtomicU64>,
) {
    // After a failure: which link failed, and how (told to every later request).
    let mut failed: Option<(usize, String)> = None;
    while let Some(command) = inbox.recv().await {
        match command {
            Command::Step {
                position,
                input,
                answer,
            } => {
                let result = match &failed {
                    Some((j, e)) => Err((
                        *j,
                        ClientError::Request(format!("an earlier step failed: {e}")),
                    )),
                    None => run_recorded(&mut links, position, &input, &config).await,
                };
                bytes.store(
                    links.iter().map(|l| l.hop.bytes_on_wire()).sum(),
                    Ordering::Relaxed,
                );
                if let (Err((j, e)), None) = (&result, &failed) {
                    tracing::debug!(error = %e, "a checking chain failed; it reports at the next check");
                    failed = Some((*j, e.to_string()));
                }
                if let Some(answer) = answer {
                    let _ = answer.send(result);
                }
            }
            Command::Surrender(to) => {
                let _ = to.send(links);
                return;
            }
        }
    }
}

impl ChainSession {
    /// Feeds hop `i`'s last input (the step at `position`, whose answer was `out`) to its shadow and, when `drawn`,
    /// checks `out` against the shadow's answer, and on a mismatch against a third chain's. Returns the answer to go
    /// on with and how many links now stand where hop `i` stood (more than one when a multi-hop chain replaced a
    /// convicted server).
    pub(super) async fn check(
        &mut self,
        i: usize,
        out: Tensor,
        position: usize,
        drawn: bool,
    ) -> Result<(Tensor, usize)> {
        let link = &self.links[i];
        let Some((_, input)) = link.history.last() else {
            return Ok((out, 1));
        };
        if !drawn {
            // Every step goes through here: nothing is copied unless a shadow takes the input.
            if let Some(shadow) = &link.shadow {
                shadow.feed(position as u32, input.clone());
            }
            return Ok((out, 1));
        }
        let started = Instant::now();
        let input = input.clone();
        let seen = link.history.len() - 1;
        let hop = link.hop.hop().clone();
        let primary = hop.peer_id().to_string();
        let shadow = match self.links[i].shadow.take() {
            Some(shadow) => shadow,
            None if self.links[i]
                .unverifiable_until
                .is_some_and(|t| started < t) =>
            {
                self.verification.unverifiable += 1;
                return Ok((out, 1));
            }
            None => match self.open_checker(i, seen, [primary.clone()].into()).await {
                Ok(shadow) => shadow,
                Err(ClientError::Uncovered { .. }) => {
                    tracing::debug!(blocks = %hop.range, "no other server holds these blocks; their answers go unchecked");
                    self.links[i].unverifiable_until = Some(started + RECHECK_AFTER);
                    self.verification.unverifiable += 1;
                    return Ok((out, 1));
                }
                Err(e) => {
                    tracing::warn!(blocks = %hop.range, error = %e, "no second chain could be opened; step unchecked");
                    self.verification.skipped += 1;
                    return Ok((out, 1));
                }
            },
        };
        let second = match shadow.answer(position as u32, input.clone()).await {
            Ok(answer) => answer,
            Err((j, e)) => {
                self.checker_failed(&shadow, j, &e);
                return Ok((out, 1));
            }
        };
        let tokens = out.dim(1).map_err(petal_model::ModelError::from)?;
        let mut numerics = self.links[i].numerics().join(&shadow.numerics);
        let mut tol = numerics.tolerance();
        let dev = deviation(&out, &second)?;
        self.verification.checked_steps += 1;
        self.verification.checked_tokens += tokens as u64;
        if dev <= tol {
            tracing::debug!(blocks = %hop.range, position, deviation = dev, "answer checked");
            self.links[i].shadow = Some(shadow);
            return Ok((out, 1));
        }
        tracing::warn!(%primary, second = ?shadow.peers, blocks = %hop.range, position, deviation = dev, tolerance = tol, "answers disagree; asking a third chain");

        let mut exclude: HashSet<String> = shadow.peers.iter().cloned().collect();
        exclude.insert(primary.clone());
        let third = match self.open_checker(i, seen, exclude).await {
            Ok(third) => match third.answer(position as u32, input).await {
                Ok(answer) => Some((third, answer)),
                Err((j, e)) => {
                    self.checker_failed(&third, j, &e);
                    None
                }
            },
            Err(e) => {
                tracing::debug!(blocks = %hop.range, error = %e, "no third chain");
                None
            }
        };
        let mut opinions = Opinions {
            primary_second: dev,
            third: None,
        };
        if let Some((third, answer)) = &third {
            opinions.third = Some((deviation(&out, answer)?, deviation(&second, answer)?));
            numerics = numerics.join(&third.numerics);
            tol = numerics.tolerance();
        }
        let verdict = judge(opinions, tol);
        let mut mismatch = Mismatch {
            blocks: hop.range,
            position,
            tokens,
            primary: primary.clone(),
            second: shadow.peers.clone(),
            third: third
                .as_ref()
                .map(|(t, _)| t.peers.clone())
                .unwrap_or_default(),
            deviation: dev,
            tolerance: tol,
            verdict,
            banned: vec![],
        };
        let result = match verdict {
            Verdict::PrimaryDeviated => {
                self.client.convict(&primary);
                mismatch.banned = vec![primary.clone()];
                let second_peers = shadow.peers.clone();
                match shadow.surrender().await {
                    Some(mut links) => {
                        // Dropping the convicted link closes its stream; its server frees the session.
                        self.links.remove(i);
                        let count = links.len();
                        if let (1, Some((third, _))) = (count, third) {
                            links[0].shadow = Some(third);
                        }
                        self.failovers.push(Failover {
                            failed_peer: primary,
                            range: hop.range,
                            reason: format!(
                                "answers deviated by {dev:.2e} (tolerance {tol:.0e}) from two chains that agreed"
                            ),
                            replayed_steps: 0,
                            elapsed: started.elapsed(),
                        });
                        self.links.splice(i..i, links);
                        (second, count)
                    }
                    None => {
                        // The second chain's task is gone: fail over the usual way, by replay.
                        tracing::warn!(second = ?second_peers, "the outvoting chain is gone; replacing the server by replay");
                        let cause = ClientError::Protocol {
                            peer: primary,
                            reason: "answers outvoted by two chains that agreed".into(),
                        };
                        let before = self.links.len();
                        self.replace(i, cause, Instant::now() + self.config.failover_budget)
                            .await?;
                        (second, self.links.len() + 1 - before)
                    }
                }
            }
            Verdict::SecondDeviated => {
                for peer in &shadow.peers {
                    self.client.convict(peer);
                }
                mismatch.banned = shadow.peers.clone();
                self.links[i].shadow = third.map(|(t, _)| t);
                (out, 1)
            }
            Verdict::Unresolved | Verdict::Agreed => {
                self.links[i].shadow = Some(shadow);
                (out, 1)
            }
        };
        tracing::warn!(verdict = ?mismatch.verdict, banned = ?mismatch.banned, blocks = %hop.range, position, "verification mismatch");
        self.verification.mismatches.push(mismatch);
        Ok(result)
    }

    /// A chain over hop `i`'s blocks on servers not in `exclude`, fed the first `seen` entries of its history.
    /// It takes `&mut self` because a future holding `&self` across an await would not be `Send` (see
    /// [`ChainSession::open_chain`]).
    async fn open_checker(
        &mut self,
        i: usize,
        seen: usize,
        exclude: HashSet<String>,
    ) -> Result<Shadow> {
        let range = self.links[i].hop.hop().range;
        let links = self.open_chain(range, exclude, true).await?;
        Ok(Shadow::start(
            links,
            &self.links[i].history[..seen],
            &self.config,
        ))
    }

    /// A second or third chain's link `j` failed: the step goes unchecked, and its server is banned like any
    /// failing server.
    fn checker_failed(&mut self, checker: &Shadow, j: usize, e: &ClientError) {
        if let (Some(peer), true) = (checker.peers.get(j), e.is_retryable()) {
            self.client.ban(peer);
        }
        tracing::warn!(error = %e, "a checking server failed; step unchecked");
        self.verification.skipped += 1;
    }
}

//! Server-to-server push for a chain session's decode steps: every hop gets its step at once, the first with the
//! input, the others told to await it from the hop before; each pushes its output on to the next and answers the
//! client too, so the client keeps every hop's input for replay. A hop that failed, and the ones after it that got
//! no push, are driven by the client from the output before them, as in a client-driven step.
use super::{ChainSession, HopTiming};
use crate::error::{ClientError, Result};
use crate::hop::PushInput;
use candle_core::Tensor;
use petal_model::compute::wire::to_wire;
use petal_proto::pb;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How long a hop waits for its input from the previous hop of a pushed step before the client drives it: what a
/// dead hop costs the ones after it. Far above a decode step's time on a healthy hop; a hop that is merely slow
/// only makes that one step client-driven.
const PUSH_WAIT: Duration = Duration::from_secs(5);

impl ChainSession {
    /// Each hop's push target, if this step can go server to server: a decode step, through two hops or more that
    /// all take pushes in one wire dtype, none of them drawn for a check (a check may replace a hop's answer, which
    /// the next hop would already have used).
    pub(super) fn push_targets(
        &self,
        tokens: usize,
        draws: &VecDeque<bool>,
    ) -> Option<Vec<pb::PushTarget>> {
        if !self.config.push
            || self.push_broken
            || tokens != 1
            || self.links.len() < 2
            || draws.iter().any(|d| *d)
        {
            return None;
        }
        let dtype = self.links[0].hop.wire_dtype();
        if self.links.iter().any(|l| l.hop.wire_dtype() != dtype) {
            return None;
        }
        self.links.iter().map(|l| l.hop.push_target()).collect()
    }

    /// One step server to server: the input to the first hop with the next hop's push target, every other hop
    /// told to await its input from the previous one; all answer at once. Hops that failed, and the ones after them
    /// that got no input, are then driven by the client from the output before them (replacing failed servers), so
    /// the result is what a client-driven step gives.
    pub(super) async fn step_pushed(
        &mut self,
        hidden: &Tensor,
        targets: Vec<pb::PushTarget>,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<(Tensor, Vec<HopTiming>)> {
        let position = self.position;
        let shape = hidden.dims().to_vec();
        let push_wait = PUSH_WAIT.min(timeout / 2);
        let first = to_wire(hidden, self.links[0].hop.wire_dtype())?;
        let steps = self.links.iter_mut().enumerate().map(|(i, link)| {
            let input = if i == 0 {
                PushInput::Sent(first.clone())
            } else {
                PushInput::Awaited {
                    shape: shape.clone(),
                    wait: push_wait,
                }
            };
            let target = targets.get(i + 1).cloned();
            async move {
                // The first hop's input goes out before the others are told to await theirs: they have a whole
                // hop's compute to get their steps, and an input pushed first waits for its step.
                if i > 0 {
                    tokio::task::yield_now().await;
                }
                link.hop.step_push(input, position, target, timeout).await
            }
        });
        let results = futures::future::join_all(steps).await;
        let timed_out = results
            .iter()
            .filter(|r| r.as_ref().is_err_and(ClientError::is_push_timeout))
            .count();
        let only_timeouts = results.iter().all(|r| match r {
            Ok(_) => true,
            Err(e) => e.is_push_timeout(),
        });
        if timed_out > 0 && only_timeouts {
            // Every server answered, yet pushes did not arrive: they cannot reach each other.
            tracing::warn!(
                timed_out,
                "servers of this route cannot push to each other; driving its steps from here"
            );
            self.push_broken = true;
        }
        let mut x = hidden.clone();
        let mut timings = Vec::with_capacity(results.len());
        let mut hop = 0;
        for result in results {
            match result {
                Ok(out) => {
                    self.links[hop].history.push((position as u32, out.sent));
                    timings.push(HopTiming {
                        round_trip: out.round_trip,
                        compute: out.compute,
                        pushed: true,
                    });
                    let (checked, links) = self.check(hop, out.hidden, position, false).await?;
                    x = checked;
                    hop += links;
                }
                Err(e) if e.is_push_timeout() || e.is_retryable() => {
                    // Not pushed (the hop before failed) or failed itself: drive it from the output before it.
                    // A hop after it that did get a push used the failed hop's real output, and its own answer
                    // stands (it carries the input it got).
                    if !e.is_push_timeout() {
                        tracing::info!(error = %e, "a pushed step failed; the client drives the hop");
                    }
                    let (out, end) = self
                        .drive(
                            hop,
                            hop + 1,
                            x,
                            &mut timings,
                            VecDeque::new(),
                            timeout,
                            deadline,
                        )
                        .await?;
                    x = out;
                    hop = end;
                }
                Err(e) => return Err(e),
            }
        }
        Ok((x, timings))
    }
}

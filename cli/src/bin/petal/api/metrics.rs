//! Prometheus metrics of `petal api`, served as OpenMetrics text on `GET /metrics`: what its completions cost and
//! what the checks of servers' answers found (`--verify`).
//!
//! | metric | type | meaning |
//! | --- | --- | --- |
//! | `petal_api_completions_total` | counter | completions finished (cancelled ones included) |
//! | `petal_api_completion_tokens_total` | counter | tokens sampled |
//! | `petal_api_failovers_total` | counter | servers replaced mid-completion (failures and convicted liars) |
//! | `petal_api_verified_steps_total` / `_tokens_total` | counter | hop steps (tokens) checked on a second server |
//! | `petal_api_unverifiable_checks_total` | counter | checks drawn where no other server holds the blocks |
//! | `petal_api_skipped_checks_total` | counter | checks whose second server failed |
//! | `petal_api_verification_mismatches_total{verdict}` | counter | disagreeing checks, by who was blamed |
//! | `petal_api_requests_waiting` | gauge | requests waiting for a generation slot (`--max-queue` bounds it) |
//! | `petal_api_requests_timed_out_total` | counter | requests stopped at `--request-timeout` (504, or an error event) |
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use petal_client::{Completion, Verdict};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;

use super::state::AppState;

type VerdictLabel = Vec<(&'static str, &'static str)>;

#[derive(Debug)]
pub struct ApiMetrics {
    registry: Registry,
    completions: Counter,
    tokens: Counter,
    failovers: Counter,
    verified_steps: Counter,
    verified_tokens: Counter,
    unverifiable: Counter,
    skipped: Counter,
    mismatches: Family<VerdictLabel, Counter>,
    waiting: Gauge,
    timed_out: Counter,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let metrics = Self {
            completions: Counter::default(),
            tokens: Counter::default(),
            failovers: Counter::default(),
            verified_steps: Counter::default(),
            verified_tokens: Counter::default(),
            unverifiable: Counter::default(),
            skipped: Counter::default(),
            mismatches: Family::default(),
            waiting: Gauge::default(),
            timed_out: Counter::default(),
            registry: Registry::default(),
        };
        let counters = [
            (
                "petal_api_completions",
                "Completions finished",
                &metrics.completions,
            ),
            (
                "petal_api_completion_tokens",
                "Tokens sampled",
                &metrics.tokens,
            ),
            (
                "petal_api_failovers",
                "Servers replaced mid-completion",
                &metrics.failovers,
            ),
            (
                "petal_api_verified_steps",
                "Hop steps checked on a second server",
                &metrics.verified_steps,
            ),
            (
                "petal_api_verified_tokens",
                "Tokens of the hop steps checked on a second server",
                &metrics.verified_tokens,
            ),
            (
                "petal_api_unverifiable_checks",
                "Checks drawn where no other server holds the blocks",
                &metrics.unverifiable,
            ),
            (
                "petal_api_skipped_checks",
                "Checks whose second server failed",
                &metrics.skipped,
            ),
            (
                "petal_api_requests_timed_out",
                "Requests stopped at --request-timeout",
                &metrics.timed_out,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "petal_api_verification_mismatches",
            "Checks whose answers disagreed, by verdict (primary_deviated, second_deviated, unresolved)",
            metrics.mismatches.clone(),
        );
        registry.register(
            "petal_api_requests_waiting",
            "Requests waiting for a generation slot",
            metrics.waiting.clone(),
        );
        Self {
            registry,
            ..metrics
        }
    }
}

impl ApiMetrics {
    /// Counts a finished completion.
    pub fn record(&self, completion: &Completion) {
        let cost = &completion.cost;
        let checks = &cost.verification;
        self.completions.inc();
        self.tokens.inc_by(completion.sampled.len() as u64);
        self.failovers.inc_by(cost.failovers.len() as u64);
        self.verified_steps.inc_by(checks.checked_steps);
        self.verified_tokens.inc_by(checks.checked_tokens);
        self.unverifiable.inc_by(checks.unverifiable);
        self.skipped.inc_by(checks.skipped);
        for m in &checks.mismatches {
            let verdict = match m.verdict {
                Verdict::Agreed => "agreed",
                Verdict::PrimaryDeviated => "primary_deviated",
                Verdict::SecondDeviated => "second_deviated",
                Verdict::Unresolved => "unresolved",
            };
            self.mismatches
                .get_or_create(&vec![("verdict", verdict)])
                .inc();
        }
    }

    /// Counts a request stopped at `--request-timeout`.
    pub fn timed_out(&self) {
        self.timed_out.inc();
    }

    /// The page, with `waiting` requests queued now.
    fn render(&self, waiting: usize) -> Result<String, std::fmt::Error> {
        self.waiting.set(i64::try_from(waiting).unwrap_or(i64::MAX));
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    match state.metrics.render(state.admission.waiting()) {
        Ok(text) => (
            [(header::CONTENT_TYPE, petal_node::metrics::CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(e) => {
            super::types::ApiError::internal(format!("rendering metrics: {e}")).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_and_the_queue_are_on_the_page() {
        let metrics = ApiMetrics::default();
        metrics.timed_out();
        metrics.timed_out();
        let page = metrics.render(3).unwrap();
        assert!(
            page.contains("\npetal_api_requests_timed_out_total 2\n"),
            "{page}"
        );
        assert!(page.contains("\npetal_api_requests_waiting 3\n"), "{page}");
    }
}

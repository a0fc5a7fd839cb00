//! `tracing` to stderr (level from RUST_LOG, else a default; text or JSON lines) and, with `--trace FILE`, every
//! trace-level span of Petal's compute path (embed, span and block forwards, hop and node steps, head, sampling)
//! to a Chrome trace: open it in Perfetto (ui.perfetto.dev) or chrome://tracing.
use std::path::Path;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The crates whose spans go to the trace file.
const TRACED_CRATES: [&str; 4] = ["petal_model", "petal_client", "petal_node", "petal_p2p"];

/// Keeps the trace file open; it is complete once this is dropped (at the end of `main`).
pub struct TraceGuard(#[allow(dead_code)] Option<tracing_chrome::FlushGuard>);

/// Installs the subscriber. A second call (tests, in-process swarms) keeps the first one.
pub fn init(format: &str, default_level: &str, trace: Option<&Path>) -> TraceGuard {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let stderr = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let stderr = if format == "json" {
        stderr.json().with_filter(filter).boxed()
    } else {
        stderr.with_filter(filter).boxed()
    };
    let (chrome, guard) = match trace {
        Some(path) => {
            let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
                .file(path)
                .include_args(true)
                .build();
            let targets = TRACED_CRATES
                .iter()
                .fold(Targets::new(), |t, c| t.with_target(*c, LevelFilter::TRACE));
            (Some(layer.with_filter(targets)), Some(guard))
        }
        None => (None, None),
    };
    let _ = tracing_subscriber::registry()
        .with(stderr)
        .with(chrome)
        .try_init();
    TraceGuard(guard)
}

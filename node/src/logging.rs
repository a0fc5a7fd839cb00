//! `tracing` to stderr, level from RUST_LOG (else `default_level`), as text or JSON lines.
use tracing_subscriber::EnvFilter;

pub fn init(format: &str, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second init (tests, the in-process demo) keeps the first subscriber.
    let _ = if format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

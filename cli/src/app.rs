//! What every binary's `main` does around its command: logging (and the trace file), the async runtime, the
//! exit code, and the shutdown signal.
use crate::logging;
use clap::Args;
use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options every binary takes.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Log format on stderr (RUST_LOG sets the level).
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Write a Chrome trace of the compute path (embed, spans, blocks, hops, head, sampling) to FILE; open it in
    /// Perfetto or chrome://tracing.
    #[arg(long, global = true, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

/// Runs `command` on a multi-threaded runtime with logging set up; an error is printed (with its causes) and
/// gives exit code 1.
pub fn run<F>(common: &CommonArgs, default_level: &str, command: F) -> ExitCode
where
    F: Future<Output = anyhow::Result<()>>,
{
    // Before logging and the runtime start their threads: they set environment variables.
    petal_model::compute::pool::pin_thread_count();
    petal_model::compute::pool::keep_candle_on_our_threads();
    let trace = logging::init(&common.log_format, default_level, common.trace.as_deref());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(command);
    // Stop the runtime's tasks before the trace file is completed, so their last spans are in it.
    drop(runtime);
    drop(trace);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await?;
    tracing::info!("signal received; shutting down");
    Ok(())
}

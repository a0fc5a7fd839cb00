//! The resident-size row: a `petal-node serve` process holding every block of the model, with no session open,
//! against the GGUF file's size.
use super::{CompareArgs, Model};
use crate::model::weights_bytes;
use crate::report::round;
use anyhow::{bail, ensure, Context, Result};
use petal_model::BlockRange;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

/// How long a `petal-node serve` process may take to load its blocks and say it serves them.
const NODE_START_TIMEOUT: Duration = Duration::from_secs(180);

/// `petal-node serve` holding every block of the model, with no session: its peak (VmHWM) and current (VmRSS)
/// resident size once it says it serves them, against the GGUF file's size.
pub(super) async fn measure(model: &Model, args: &CompareArgs) -> Result<Value> {
    let bin = match &args.node_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("petal-node"),
    };
    ensure!(
        bin.is_file(),
        "{} not found: build it (cargo build --release -p petal-cli --bin petal-node) or pass --node-bin",
        bin.display()
    );
    let blocks = BlockRange::new(0, model.blocks());
    let mut child = tokio::process::Command::new(&bin)
        .args([
            "serve",
            "--no-relay",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--blocks",
        ])
        .arg(blocks.to_string())
        .arg("--model")
        .arg(&model.path)
        .args(
            model
                .kv_dtype
                .iter()
                .flat_map(|d| ["--kv-dtype".to_string(), d.as_str().to_string()]),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let measured = async {
        let stdout = child.stdout.take().context("no stdout from petal-node")?;
        tokio::time::timeout(NODE_START_TIMEOUT, wait_serving(stdout))
            .await
            .context("petal-node did not start serving in time")??;
        let pid = child.id().context("petal-node exited")?;
        proc_status(pid)
    }
    .await;
    // The node is ours and its state is of no use after this: kill it rather than wait for a drain.
    let _ = child.kill().await;
    let (hwm, rss) = measured?;
    let gguf = weights_bytes(&model.path);
    tracing::info!(vm_hwm = hwm, vm_rss = rss, gguf, "node resident size");
    Ok(json!({
        "blocks": blocks.to_string(),
        "vm_hwm_bytes": hwm,
        "vm_rss_bytes": rss,
        "gguf_bytes": gguf,
        "hwm_ratio_to_gguf": round(hwm as f64 / gguf.max(1) as f64, 3),
        "rss_ratio_to_gguf": round(rss as f64 / gguf.max(1) as f64, 3),
    }))
}

/// Reads the node's stdout until it says it serves its blocks.
async fn wait_serving(stdout: tokio::process::ChildStdout) -> Result<()> {
    let mut lines = BufReader::new(stdout).lines();
    while let Some(line) = lines.next_line().await? {
        if line.starts_with("serving blocks") {
            return Ok(());
        }
    }
    bail!("petal-node exited before serving its blocks")
}

/// VmHWM and VmRSS of process `pid`, in bytes, from /proc (Linux).
fn proc_status(pid: u32) -> Result<(u64, u64)> {
    let path = Path::new("/proc").join(pid.to_string()).join("status");
    let status =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name} in {}", path.display()))?;
        let kb: u64 = line
            .trim_start_matches(name)
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("bad {name} line {line:?}"))?;
        Ok(kb * 1024)
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

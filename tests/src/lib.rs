//! Fixtures for the multi-node integration tests: real `petal-node` and `petal` processes on loopback.
//!
//! The binaries are not built by `cargo test`: run `cargo build --release --workspace --bins` first (the
//! tests look for them next to the test executable, or in `$PETAL_BIN_DIR`). Model files come from
//! `../shared/models` beside the checkout (or `$PETAL_MODELS`); they are never downloaded.
//!
//! Every process a test starts is owned by a [`Proc`], which SIGKILLs it on drop, so a failing (panicking)
//! test leaks nothing; every wait has a deadline, so no test can hang.

pub mod hub_server;

use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

/// How long a node may take to load its span, measure its throughput, announce and print `serving blocks`.
/// Loading a SmolLM2 span on two cores shared with other processes takes a few seconds; this is generous.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one `petal generate` may run before the test calls it hung.
pub const GENERATE_TIMEOUT: Duration = Duration::from_secs(120);

/// Every listener in the tests: loopback, a port chosen by the kernel (the real one is printed).
pub const LISTEN: &str = "/ip4/127.0.0.1/tcp/0";

// ---------------------------------------------------------------------------------------------------------------
// Paths

/// Directory holding `petal-node` and `petal`: `$PETAL_BIN_DIR`, else `target/<profile>/` (the test executable
/// is `target/<profile>/deps/<test>-<hash>`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PETAL_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("cannot find the test executable");
    exe.parent()
        .and_then(Path::parent)
        .expect("test executable has no grandparent directory")
        .to_path_buf()
}

/// Path of one of the workspace binaries; panics with the command to build them when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "binary {} not found: run `cargo build --release --workspace --bins` before `cargo test --release` \
         (or set PETAL_BIN_DIR to the directory holding petal-node and petal)",
        path.display()
    );
    path
}

/// A shared model file, found by the project's one lookup (`$PETAL_MODELS`, else `../shared/models`).
pub fn shared_model(relative: &str) -> PathBuf {
    let path = petal_model::models_dir::find_model(relative)
        .unwrap_or_else(|| panic!("{}", petal_model::models_dir::missing_model(relative)));
    path.canonicalize().unwrap_or(path)
}

/// stories260K in llama2.c format (5 blocks).
pub fn stories_bin() -> PathBuf {
    shared_model("stories260K/stories260K.bin")
}

/// stories260K in Hugging Face layout (5 blocks).
pub fn stories_hf() -> PathBuf {
    shared_model("stories260K/hf")
}

/// SmolLM2-135M-Instruct, Q4_1 GGUF (30 blocks).
pub fn smollm_gguf() -> PathBuf {
    shared_model(petal_model::models_dir::DEFAULT_MODEL)
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("non-UTF-8 path").to_string()
}

// ---------------------------------------------------------------------------------------------------------------
// Processes

/// A long-running child process: stdout lines arrive through a channel (read by a thread), stderr goes to a
/// log file printed when something fails. SIGKILLed and reaped on drop.
pub struct Proc {
    pub name: String,
    child: Child,
    lines: Receiver<String>,
    /// Every stdout line received so far.
    pub stdout: Vec<String>,
    log: tempfile::NamedTempFile,
    exit: Option<ExitStatus>,
}

impl Proc {
    /// Starts `cmd` with stdout piped and stderr to a fresh log file. Logs are plain text (NO_COLOR).
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        let log = tempfile::Builder::new()
            .prefix(&format!("petal-test-{name}-"))
            .suffix(".log")
            .tempfile()
            .expect("cannot create a log file");
        let stderr = log.reopen().expect("cannot reopen the log file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .env("NO_COLOR", "1");
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        let out = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = mpsc::channel();
        thread::Builder::new()
            .name(format!("{name}-stdout"))
            .spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })
            .expect("cannot start a reader thread");
        Proc {
            name: name.to_string(),
            child,
            lines: rx,
            stdout: vec![],
            log,
            exit: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its resident memory now, in bytes.
    pub fn rss(&self) -> u64 {
        proc_status_bytes(self.pid(), "VmRSS")
    }

    /// Waits until a stdout line satisfies `pred` and returns it; panics (with the process's stderr) when the
    /// process exits first or `timeout` passes.
    pub fn wait_for_line(
        &mut self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.stdout.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "{}: no {what} line on stdout within {timeout:?}\n{}",
                        self.name,
                        self.report()
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // stdout closed: the process exited (or is about to). Give it a moment to be reaped.
                    let status = self.wait_exit(Duration::from_secs(5));
                    panic!(
                        "{}: exited ({status:?}) before printing a {what} line\n{}",
                        self.name,
                        self.report()
                    )
                }
            }
        }
    }

    /// The stderr log so far.
    pub fn stderr_log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Stdout seen so far and the last lines of stderr, for failure messages.
    pub fn report(&self) -> String {
        let log = self.stderr_log();
        let lines: Vec<&str> = log.lines().collect();
        let tail = &lines[lines.len().saturating_sub(40)..];
        format!(
            "---- {} (pid {}) stdout ----\n{}\n---- {} stderr (last {} lines of {}) ----\n{}\n",
            self.name,
            self.pid(),
            self.stdout.join("\n"),
            self.name,
            tail.len(),
            self.log.path().display(),
            tail.join("\n")
        )
    }

    fn signal(&self, sig: &str) {
        // The child is not reaped until we wait on it, so its pid cannot have been reused.
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .stderr(Stdio::null())
            .status()
            .expect("cannot run `kill`");
        assert!(
            status.success() || self.exit.is_some(),
            "kill -{sig} {} failed",
            self.pid()
        );
    }

    /// Sends SIGTERM (graceful shutdown).
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends SIGKILL (a crash: no goodbye to the swarm).
    pub fn sigkill(&self) {
        self.signal("KILL");
    }

    /// The exit status if the process has exited within `timeout`, else None (the process keeps running).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait failed");
        }
        self.exit
    }

    /// Whether the process is still running.
    pub fn is_alive(&mut self) -> bool {
        self.try_exit().is_none()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.try_exit().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The result of a short-lived command run to completion (or killed at its deadline).
#[derive(Debug)]
pub struct CmdOutput {
    /// None when the command was killed at the deadline.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub command: String,
}

impl CmdOutput {
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    pub fn timed_out(&self) -> bool {
        self.status.is_none()
    }
}

impl std::fmt::Display for CmdOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "$ {}\n{}  after {:.2?}\n---- stdout ----\n{}\n---- stderr ----\n{}",
            self.command,
            match self.status {
                Some(s) => format!("exited with {s}"),
                None => "KILLED at its deadline".to_string(),
            },
            self.elapsed,
            self.stdout,
            self.stderr
        )
    }
}

/// A size field (`VmRSS`, `VmHWM`, ...) of `/proc/PID/status`, in bytes (Linux).
pub fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    kb * 1024
}

/// Runs `cmd` to completion, SIGKILLing it after `timeout`; collects stdout and stderr.
pub fn run_with_timeout(mut cmd: Command, timeout: Duration) -> CmdOutput {
    let command = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("NO_COLOR", "1");
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {command}: {e}"));
    let drain = |r: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let mut buf = vec![];
                let _ = r.read_to_end(&mut buf);
                s = String::from_utf8_lossy(&buf).into_owned();
            }
            s
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let deadline = start + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait failed") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    CmdOutput {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        elapsed,
        command,
    }
}

/// Polls `cond` every `every` until it holds (returns the time it took) or `timeout` passes (None).
pub fn poll_until(
    timeout: Duration,
    every: Duration,
    mut cond: impl FnMut() -> bool,
) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if cond() {
            return Some(start.elapsed());
        }
        if start.elapsed() >= timeout {
            return None;
        }
        thread::sleep(every);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Swarm

/// One `petal-node serve` process to start.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    pub model: PathBuf,
    pub blocks: String,
    pub name: String,
    pub args: Vec<String>,
    /// Extra environment variables of the node process (e.g. HF_ENDPOINT, HF_HOME).
    pub envs: Vec<(String, String)>,
}

/// Builds a [`Swarm`]: a bootstrap peer and N nodes, all on loopback.
#[derive(Default)]
pub struct SwarmBuilder {
    record_ttl: Option<f64>,
    swarm_key: Option<PathBuf>,
    nodes: Vec<NodeSpec>,
}

impl SwarmBuilder {
    /// `--record-ttl SECS` for the bootstrap and every node.
    pub fn record_ttl(mut self, secs: f64) -> Self {
        self.record_ttl = Some(secs);
        self
    }

    /// A private swarm: `--swarm-key FILE` for the bootstrap, every node (unless its own arguments name another)
    /// and every client command run through [`Swarm`].
    pub fn swarm_key(mut self, file: impl AsRef<Path>) -> Self {
        self.swarm_key = Some(file.as_ref().to_path_buf());
        self
    }

    /// A node serving `blocks` ("A..B"; "": chosen by the node) of `model`, named node1, node2, ... in order.
    pub fn node(self, model: impl AsRef<Path>, blocks: &str) -> Self {
        self.node_with(model, blocks, &[])
    }

    /// A node with extra `petal-node serve` arguments (e.g. `["--dtype", "f16"]`).
    pub fn node_with(self, model: impl AsRef<Path>, blocks: &str, args: &[&str]) -> Self {
        self.node_env(model, blocks, args, &[])
    }

    /// A node with extra arguments and environment variables.
    pub fn node_env(
        mut self,
        model: impl AsRef<Path>,
        blocks: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Self {
        let name = format!("node{}", self.nodes.len() + 1);
        self.nodes.push(NodeSpec {
            model: model.as_ref().to_path_buf(),
            blocks: blocks.to_string(),
            name,
            args: args.iter().map(|s| s.to_string()).collect(),
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        });
        self
    }

    /// Starts the bootstrap, then every node at once, and waits until each prints `serving blocks`.
    pub fn start(self) -> Swarm {
        let mut cmd = Command::new(bin("petal-node"));
        cmd.args(["bootstrap", "--listen", LISTEN]);
        if let Some(key) = &self.swarm_key {
            cmd.arg("--swarm-key").arg(key);
        }
        if let Some(ttl) = self.record_ttl {
            cmd.args(["--record-ttl", &ttl.to_string()]);
        }
        let mut bootstrap = Proc::spawn("bootstrap", cmd);
        let line = bootstrap.wait_for_line("`listening on`", STARTUP_TIMEOUT, |l| {
            l.starts_with("listening on ") && l.contains("/p2p/")
        });
        let bootstrap_addr = line["listening on ".len()..].trim().to_string();

        let mut swarm = Swarm {
            bootstrap,
            bootstrap_addr,
            record_ttl: self.record_ttl,
            swarm_key: self.swarm_key,
            nodes: vec![],
        };
        for spec in self.nodes {
            swarm.spawn_node(spec);
        }
        for i in 0..swarm.nodes.len() {
            swarm.wait_serving(i);
        }
        swarm
    }
}

/// A running `petal-node serve` process.
pub struct Node {
    pub spec: NodeSpec,
    pub proc: Proc,
    /// `listening on` addresses (with /p2p/<peer id>).
    pub addrs: Vec<String>,
    pub peer_id: String,
    pub model_id: String,
}

impl Node {
    /// The TCP port of the first `/ip4/127.0.0.1/tcp/PORT` listen address.
    pub fn tcp_port(&self) -> u16 {
        self.addrs
            .iter()
            .find_map(|a| {
                let rest = a.strip_prefix("/ip4/127.0.0.1/tcp/")?;
                rest.split('/').next()?.parse().ok()
            })
            .unwrap_or_else(|| {
                panic!(
                    "{}: no loopback TCP address in {:?}",
                    self.spec.name, self.addrs
                )
            })
    }
}

/// A bootstrap peer and nodes, each a real process; all SIGKILLed on drop. When dropped during a panic
/// (a failed assertion) it prints every process's stdout and stderr tail first.
pub struct Swarm {
    pub bootstrap: Proc,
    /// The bootstrap's address with /p2p/<peer id>, for `--bootstrap`.
    pub bootstrap_addr: String,
    pub record_ttl: Option<f64>,
    /// The private swarm's key file, passed to every node and client command.
    pub swarm_key: Option<PathBuf>,
    pub nodes: Vec<Node>,
}

impl Swarm {
    pub fn builder() -> SwarmBuilder {
        SwarmBuilder::default()
    }

    fn spawn_node(&mut self, spec: NodeSpec) {
        let mut cmd = Command::new(bin("petal-node"));
        cmd.arg("serve")
            .arg("--model")
            .arg(&spec.model)
            .args(["--listen", LISTEN])
            .args(["--bootstrap", &self.bootstrap_addr])
            .args(["--public-name", &spec.name]);
        // No blocks: the node chooses them.
        if !spec.blocks.is_empty() {
            cmd.args(["--blocks", &spec.blocks]);
        }
        if let Some(ttl) = self.record_ttl {
            cmd.args(["--record-ttl", &ttl.to_string()]);
        }
        if let Some(key) = self
            .swarm_key
            .as_ref()
            .filter(|_| !spec.args.iter().any(|a| a == "--swarm-key"))
        {
            cmd.arg("--swarm-key").arg(key);
        }
        cmd.args(&spec.args);
        cmd.envs(spec.envs.iter().map(|(k, v)| (k, v)));
        let proc = Proc::spawn(&spec.name, cmd);
        self.nodes.push(Node {
            spec,
            proc,
            addrs: vec![],
            peer_id: String::new(),
            model_id: String::new(),
        });
    }

    fn wait_serving(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let line = node
            .proc
            .wait_for_line("`serving blocks`", STARTUP_TIMEOUT, |l| {
                l.starts_with("serving blocks ")
            });
        node.model_id = line
            .rsplit(' ')
            .next()
            .expect("serving line has words")
            .to_string();
        node.addrs = node
            .proc
            .stdout
            .iter()
            .filter_map(|l| l.strip_prefix("listening on "))
            .map(|a| a.trim().to_string())
            .collect();
        node.peer_id = node
            .addrs
            .first()
            .and_then(|a| a.rsplit("/p2p/").next())
            .unwrap_or_else(|| {
                panic!(
                    "{}: no `listening on` line\n{}",
                    node.spec.name,
                    node.proc.report()
                )
            })
            .to_string();
    }

    /// Starts one more node with this swarm's bootstrap and TTL and waits until it serves.
    pub fn add_node(&mut self, model: impl AsRef<Path>, blocks: &str, args: &[&str]) -> &mut Node {
        let spec = NodeSpec {
            model: model.as_ref().to_path_buf(),
            blocks: blocks.to_string(),
            name: format!("node{}", self.nodes.len() + 1),
            args: args.iter().map(|s| s.to_string()).collect(),
            envs: vec![],
        };
        self.spawn_node(spec);
        let i = self.nodes.len() - 1;
        self.wait_serving(i);
        &mut self.nodes[i]
    }

    /// A `petal generate --json` through this swarm.
    pub fn generate(&self, model: impl AsRef<Path>, prompt: &str) -> Generate {
        let generate = Generate::new(model, prompt).bootstrap(&self.bootstrap_addr);
        match &self.swarm_key {
            Some(key) => generate.arg("--swarm-key").arg(&path_str(key)),
            None => generate,
        }
    }

    /// `petal swarm --json`: the live server records as the bootstrap's DHT shows them.
    pub fn records(&self) -> Vec<Value> {
        self.records_as(self.swarm_key.as_deref())
    }

    /// [`Swarm::records`] as a client holding `swarm_key` (or none) sees them.
    pub fn records_as(&self, swarm_key: Option<&Path>) -> Vec<Value> {
        let mut cmd = Command::new(bin("petal"));
        cmd.args([
            "swarm",
            "--json",
            "--timeout",
            "2",
            "--bootstrap",
            &self.bootstrap_addr,
        ]);
        if let Some(key) = swarm_key {
            cmd.arg("--swarm-key").arg(key);
        }
        let out = run_with_timeout(cmd, Duration::from_secs(30));
        assert!(out.success(), "petal swarm failed\n{out}");
        let v: Value = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("petal swarm --json printed no JSON array ({e})\n{out}"));
        v.as_array()
            .cloned()
            .unwrap_or_else(|| panic!("not a JSON array\n{out}"))
    }

    /// Peer ids listed by `petal swarm --json`.
    pub fn listed_peers(&self) -> Vec<String> {
        self.records()
            .iter()
            .map(|r| r["peer_id"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Every process's stdout and stderr tail.
    pub fn report(&self) -> String {
        let mut s = self.bootstrap.report();
        for n in &self.nodes {
            s.push_str(&n.proc.report());
        }
        s
    }
}

impl Swarm {
    /// SIGKILLs the node named `name` and waits for it to exit; returns its blocks.
    pub fn kill(&mut self, name: &str) -> String {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.spec.name == name)
            .unwrap_or_else(|| panic!("no node named {name}"));
        node.proc.sigkill();
        assert!(node.proc.wait_exit(Duration::from_secs(5)).is_some());
        node.spec.blocks.clone()
    }
}

/// The JSON line a background `petal generate --json` ([`Generate::spawn`]) prints at its end (waiting up to
/// `timeout`), and its tokens.
pub fn spawned_json(client: &mut Proc, timeout: Duration) -> (Value, Vec<u32>) {
    let line = client.wait_for_line("JSON", timeout, |l| l.starts_with('{'));
    let v: Value = serde_json::from_str(&line).expect("JSON from petal generate");
    let tokens = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(|t| t.as_u64().map(|t| t as u32))
        .collect();
    (v, tokens)
}

impl Drop for Swarm {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "==== swarm processes at the failure ====\n{}",
                self.report()
            );
        }
        // Nodes first, then the bootstrap; each Proc SIGKILLs itself as it drops.
        self.nodes.clear();
    }
}

// ---------------------------------------------------------------------------------------------------------------
// petal generate

/// `petal generate ... --json`, built up with options and run with a deadline.
#[derive(Clone, Debug)]
pub struct Generate {
    args: Vec<String>,
    envs: Vec<(String, String)>,
    timeout: Duration,
}

/// The JSON line `petal generate --json` prints.
#[derive(Clone, Debug)]
pub struct GenOutput {
    pub prompt_tokens: u64,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: String,
    pub tokens_per_second: f64,
    pub first_token_ms: f64,
    pub total_ms: f64,
    /// Swarm runs only: one entry per hop.
    pub route: Option<Vec<String>>,
    pub raw: Value,
    pub elapsed: Duration,
    /// What `petal generate` logged (warnings such as failovers).
    pub stderr: String,
}

impl Generate {
    pub fn new(model: impl AsRef<Path>, prompt: &str) -> Self {
        Generate {
            args: vec![
                "generate".into(),
                "--json".into(),
                "--model".into(),
                path_str(model.as_ref()),
                "--prompt".into(),
                prompt.into(),
            ],
            envs: vec![],
            timeout: GENERATE_TIMEOUT,
        }
    }

    /// An environment variable of the `petal` process.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.envs.push((key.to_string(), value.to_string()));
        self
    }

    /// Every block in the `petal` process itself.
    pub fn local(self) -> Self {
        self.arg("--local")
    }

    pub fn bootstrap(self, addr: &str) -> Self {
        self.args(&["--bootstrap", addr])
    }

    pub fn max_new_tokens(self, n: usize) -> Self {
        self.args(&["--max-new-tokens", &n.to_string()])
    }

    pub fn ignore_eos(self) -> Self {
        self.arg("--ignore-eos")
    }

    pub fn chat(self) -> Self {
        self.arg("--chat")
    }

    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_string());
        self
    }

    pub fn args(mut self, a: &[&str]) -> Self {
        self.args.extend(a.iter().map(|s| s.to_string()));
        self
    }

    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Starts it in the background with extra environment variables (e.g. RUST_LOG), for tests that act while it
    /// runs; its JSON line arrives on the process's stdout.
    pub fn spawn(&self, name: &str, envs: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(bin("petal"));
        cmd.args(&self.args);
        cmd.envs(self.envs.iter().map(|(k, v)| (k, v)));
        for (k, v) in envs {
            cmd.env(k, v);
        }
        Proc::spawn(name, cmd)
    }

    /// Starts it in the background logging `session opened` (RUST_LOG=petal_client=info), waits (60 s at most)
    /// until it has, and returns the process and the route's node names in order: `route=node1(…)[0..10] ->
    /// node2(…)[10..20]` gives `["node1", "node2"]`. For tests that kill a hop mid-generation.
    pub fn spawn_routed(&self, name: &str) -> (Proc, Vec<String>) {
        let client = self.spawn(name, &[("RUST_LOG", "petal_client=info")]);
        assert!(
            poll_until(Duration::from_secs(60), Duration::from_millis(10), || {
                client.stderr_log().contains("session opened")
            })
            .is_some(),
            "no session opened\n{}",
            client.report()
        );
        let log = client.stderr_log();
        let route = log
            .lines()
            .find_map(|l| l.split("route=").nth(1))
            .unwrap_or_default();
        let hops = route
            .split(" -> ")
            .map(|h| h.split('(').next().unwrap_or("").trim().to_string())
            .collect();
        (client, hops)
    }

    /// Runs it undisturbed in the background ([`Generate::spawn_routed`]), checks that it gives `expected`, and
    /// returns how long it took from its session opening to its JSON line. Tests that kill a hop mid-generation
    /// place the kill at a fraction of this: a fixed delay stops landing mid-generation once decoding gets faster
    /// than it assumed.
    pub fn time_routed(&self, name: &str, expected: &[u32]) -> Duration {
        let (mut client, _) = self.spawn_routed(name);
        let opened = Instant::now();
        let (_, tokens) = spawned_json(&mut client, Duration::from_secs(120));
        let took = opened.elapsed();
        assert_eq!(
            tokens,
            expected,
            "{name}: undisturbed run\n{}",
            client.report()
        );
        eprintln!(
            "{name}: undisturbed generation {} ms after its session opened",
            took.as_millis()
        );
        took
    }

    /// Runs it, whatever the outcome.
    pub fn run(&self) -> CmdOutput {
        let mut cmd = Command::new(bin("petal"));
        cmd.args(&self.args);
        cmd.envs(self.envs.iter().map(|(k, v)| (k, v)));
        run_with_timeout(cmd, self.timeout)
    }

    /// Runs it and parses its JSON line; panics with the command's output when it fails.
    pub fn run_json(&self) -> GenOutput {
        let out = self.run();
        assert!(out.success(), "petal generate failed\n{out}");
        parse_generate_json(&out)
    }
}

fn parse_generate_json(out: &CmdOutput) -> GenOutput {
    let line = out
        .stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .unwrap_or_else(|| panic!("petal generate --json printed no JSON object\n{out}"));
    let v: Value = serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("bad JSON from petal generate ({e})\n{out}"));
    let num = |k: &str| {
        v[k].as_f64()
            .unwrap_or_else(|| panic!("JSON field {k} missing or not a number\n{out}"))
    };
    let tokens = v["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("JSON field tokens missing\n{out}"))
        .iter()
        .map(|t| t.as_u64().expect("token ids are integers") as u32)
        .collect();
    let route = v.get("route").and_then(Value::as_array).map(|hops| {
        hops.iter()
            .map(|h| h.as_str().unwrap_or_default().to_string())
            .collect()
    });
    GenOutput {
        prompt_tokens: num("prompt_tokens") as u64,
        tokens,
        text: v["text"].as_str().unwrap_or_default().to_string(),
        finish_reason: v["finish_reason"].as_str().unwrap_or_default().to_string(),
        tokens_per_second: num("tokens_per_second"),
        first_token_ms: num("first_token_ms"),
        total_ms: num("total_ms"),
        route,
        raw: v,
        elapsed: out.elapsed,
        stderr: out.stderr.clone(),
    }
}

/// Asserts two runs produced the same tokens, printing both texts and the first difference when not.
pub fn assert_same_tokens(what: &str, swarm: &GenOutput, local: &GenOutput) {
    if swarm.tokens != local.tokens {
        let first_diff = swarm
            .tokens
            .iter()
            .zip(&local.tokens)
            .position(|(a, b)| a != b)
            .unwrap_or(swarm.tokens.len().min(local.tokens.len()));
        panic!(
            "{what}: swarm and local tokens differ (first at index {first_diff}; {} vs {} tokens)\n\
             swarm: {:?}\n       {:?}\nlocal: {:?}\n       {:?}",
            swarm.tokens.len(),
            local.tokens.len(),
            swarm.tokens,
            swarm.text,
            local.tokens,
            local.text
        );
    }
}

/// A tiny deterministic PRNG (xorshift64*) for hostile bytes, so failures can be replayed from the seed.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

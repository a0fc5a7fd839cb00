//! Continuous batching on a real node process: concurrent sessions through one `petal-node` are computed in shared
//! batches (its `petal_batch_sessions` metric shows batches of more than one session) and each session generates
//! exactly the greedy tokens it generates alone.
use petal_client::{ChainConfig, Generator, SwarmClient};
use petal_model::{GenerationConfig, ModelSource, Placement};
use petal_tests::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

const SESSIONS: usize = 12;
const NEW_TOKENS: usize = 24;

/// `GET /metrics` from the node's metrics server.
fn scrape(addr: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect to the metrics server");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send request");
    let mut page = String::new();
    stream.read_to_string(&mut page).expect("read metrics");
    page
}

/// The value of the sample named exactly `series` (labels included).
fn sample(page: &str, series: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse::<f64>().ok())?
        })
        .unwrap_or_else(|| panic!("no sample {series} in\n{page}"))
}

/// (batches, batches of more than one session) so far.
fn batches(page: &str) -> (f64, f64) {
    let count = sample(page, "petal_batch_sessions_count");
    let single = sample(page, "petal_batch_sessions_bucket{le=\"1.0\"}");
    (count, count - single)
}

/// A generator over the swarm that finds its servers within 10 s and never fails over (a failure is the test's).
fn remote_generator(client: &SwarmClient, source: &ModelSource) -> Arc<Generator> {
    let chain = ChainConfig {
        discovery_timeout: Duration::from_secs(10),
        failover_budget: Duration::ZERO,
        ..ChainConfig::default()
    };
    Arc::new(Generator::remote(client, source, Placement::cpu_f32(), chain).expect("generator"))
}

#[test]
fn concurrent_sessions_through_one_node_are_batched_and_match_each_run_alone() {
    let model = stories_bin();
    let swarm = Swarm::builder()
        .node_with(&model, "0..5", &["--metrics-listen", "127.0.0.1:0"])
        .start();
    let metrics = swarm.nodes[0]
        .proc
        .stdout
        .iter()
        .find_map(|l| {
            l.strip_prefix("metrics on http://")?
                .strip_suffix("/metrics")
        })
        .unwrap_or_else(|| panic!("no `metrics on` line: {:?}", swarm.nodes[0].proc.stdout))
        .to_string();
    let bootstrap: petal_p2p::Multiaddr = swarm.bootstrap_addr.parse().expect("bootstrap address");
    let source = ModelSource::open(&model).expect("model");
    let vocab = source.spec().vocab_size as u32;
    // Prompts of 1 to 12 tokens, all different.
    let prompts: Vec<Vec<u32>> = (0..SESSIONS as u32)
        .map(|i| (0..=i).map(|k| (i * 53 + k * 17 + 3) % vocab).collect())
        .collect();
    let config = GenerationConfig {
        max_new_tokens: NEW_TOKENS,
        ignore_eos: true,
        ..GenerationConfig::default()
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = SwarmClient::connect(vec![bootstrap])
            .await
            .expect("client");
        let generator = remote_generator(&client, &source);

        // Each session alone, one after the other.
        let mut alone = vec![];
        for prompt in &prompts {
            let done = generator
                .generate_ids(prompt, &config)
                .await
                .expect("lone generation");
            assert_eq!(done.sampled.len(), NEW_TOKENS);
            alone.push(done.sampled);
        }
        let (before, before_shared) = batches(&scrape(&metrics));
        assert_eq!(before_shared, 0.0, "lone sessions never share a batch");

        // All at once.
        let tasks: Vec<_> = prompts
            .iter()
            .cloned()
            .map(|prompt| {
                let generator = generator.clone();
                let config = config.clone();
                tokio::spawn(async move { generator.generate_ids(&prompt, &config).await })
            })
            .collect();
        for (i, (task, alone)) in tasks.into_iter().zip(&alone).enumerate() {
            let together = task.await.expect("task").expect("concurrent generation");
            assert_eq!(
                &together.sampled, alone,
                "session {i}: concurrent tokens differ from the lone run"
            );
        }
        let page = scrape(&metrics);
        let (after, shared) = batches(&page);
        let steps = sample(&page, "petal_batch_sessions_sum");
        eprintln!(
            "{SESSIONS} concurrent sessions: {} batches, {shared} of them shared; {steps} steps batched in all",
            after - before
        );
        assert!(
            shared > 0.0,
            "no batch held more than one session:\n{page}"
        );
        assert!(
            after - before < (SESSIONS * NEW_TOKENS) as f64,
            "concurrent steps should take fewer batches than steps"
        );
    });
}

/// Sixteen sessions opened at the same moment by a client that is connected to nothing but the bootstrap peer yet
/// (an API server whose first users all arrive at once): every one opens its streams on a route of two nodes, the
/// dials to each node are shared rather than aborting one another, and each session generates what it generates
/// alone.
#[test]
fn sessions_opened_at_once_by_a_fresh_client_all_open() {
    const AT_ONCE: usize = 16;
    let model = stories_bin();
    let swarm = Swarm::builder()
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    let bootstrap: petal_p2p::Multiaddr = swarm.bootstrap_addr.parse().expect("bootstrap address");
    let source = ModelSource::open(&model).expect("model");
    let vocab = source.spec().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..AT_ONCE as u32)
        .map(|i| (0..=i % 5).map(|k| (i * 31 + k * 11 + 5) % vocab).collect())
        .collect();
    let config = GenerationConfig {
        max_new_tokens: 4,
        ignore_eos: true,
        ..GenerationConfig::default()
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let generator = remote_generator(&client, &source);
        let tasks: Vec<_> = prompts
            .iter()
            .cloned()
            .map(|prompt| {
                let (generator, config) = (generator.clone(), config.clone());
                tokio::spawn(async move { generator.generate_ids(&prompt, &config).await })
            })
            .collect();
        let mut together = vec![];
        for (i, task) in tasks.into_iter().enumerate() {
            let done = task
                .await
                .expect("task")
                .unwrap_or_else(|e| panic!("session {i} of {AT_ONCE} opened at once: {e}"));
            together.push(done.sampled);
        }
        for (i, (prompt, together)) in prompts.iter().zip(&together).enumerate() {
            let alone = generator
                .generate_ids(prompt, &config)
                .await
                .expect("lone generation");
            assert_eq!(
                &alone.sampled, together,
                "session {i}: tokens differ from its lone run"
            );
        }
    });
}

//! `--model org/name[@revision]`: models from a Hugging Face hub, here one on loopback ([`HubServer`]) serving
//! stories260K split into four shards (blocks 0-1, 2-3, 4, and the head) and a GGUF repository.
//!
//! Each role must fetch exactly what it reads: a node its blocks' shards (and a moved node its new span's), a
//! client the head's; a cached run nothing but the revision lookup; offline with an empty cache is a clear error.
//! The spawned binaries, pointed at the server with HF_ENDPOINT, generate the same tokens as the local directory.
use petal_model::hub::{self, HubConfig, ModelRef};
use petal_model::{BlockRange, ModelError, ModelFormat, ModelSource, Placement};
use petal_tests::hub_server::*;
use petal_tests::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const REPO: &str = "petal-test/stories-sharded";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const GGUF_REPO: &str = "petal-test/smollm-gguf";
const GGUF_COMMIT: &str = "89abcdef0123456789abcdef0123456789abcdef";
/// What every role of the sharded repository fetches before any weight.
const METADATA: [&str; 4] = [
    "config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
];
const PROMPT: &str = "Once upon a time";

fn stories_server() -> HubServer {
    HubServer::start(vec![stories_sharded(REPO, COMMIT, &stories_hf())])
}

/// A configuration reading nothing from the environment: this server, this cache, no token.
fn config(endpoint: &str, home: &Path) -> HubConfig {
    HubConfig {
        endpoint: endpoint.to_string(),
        cache_dir: Some(home.join("hub")),
        token: None,
        offline: false,
        progress: None,
    }
}

fn files(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn metadata_and(shards: &[&str]) -> BTreeSet<String> {
    let mut set = files(&METADATA);
    set.extend(files(shards));
    set
}

fn open(model: &str, config: &HubConfig) -> ModelSource {
    let mut source = hub::open(&ModelRef::parse(model), config)
        .unwrap_or_else(|e| panic!("opening {model}: {e}"));
    source.set_hash_cache(None);
    source
}

fn open_err(model: &ModelRef, config: &HubConfig) -> ModelError {
    match hub::open(model, config) {
        Ok(_) => panic!("opening {model} should fail"),
        Err(e) => e,
    }
}

fn local_stories() -> ModelSource {
    let mut local = ModelSource::open(stories_hf()).expect("the shared stories260K hf directory");
    local.set_hash_cache(None);
    local
}

/// The files of the snapshot of `repo` at `commit` under the cache of `home`.
fn snapshot_files(home: &Path, repo: &str, commit: &str) -> BTreeSet<String> {
    let dir = home
        .join("hub")
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(commit);
    match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect(),
        Err(_) => BTreeSet::new(),
    }
}

/// Asserts hf-hub's request pattern for a fresh download: each file's `bytes=0-0` probe (commit, etag, size)
/// comes before its body request.
fn assert_probe_then_body(requests: &[HubRequest]) {
    for (i, r) in requests.iter().enumerate().filter(|(_, r)| r.is_download()) {
        let file = r.file().unwrap();
        assert!(
            requests[..i]
                .iter()
                .any(|p| p.file() == Some(file) && p.range.as_deref() == Some("bytes=0-0")),
            "no metadata probe before downloading {file}: {requests:#?}"
        );
        assert_eq!(r.method, "GET");
    }
}

#[test]
fn a_node_fetches_only_the_shards_of_its_blocks_and_of_a_span_it_moves_to() {
    let server = stories_server();
    let home = tempfile::tempdir().unwrap();
    let source = open(REPO, &config(&server.url, home.path()));
    assert_eq!(
        server.downloads(),
        files(&METADATA),
        "opening reads metadata only"
    );
    let requests = server.requests();
    assert_eq!(
        requests[0].path,
        format!("/api/models/{REPO}/revision/main"),
        "the revision is resolved first: {requests:#?}"
    );

    let range = BlockRange::new(2, 4);
    source
        .load_span_on(range, &Placement::cpu_f32())
        .expect("load blocks 2..4");
    let hashes = source.block_hashes(range).expect("hash blocks 2..4");
    for r in server.requests() {
        eprintln!("{} {} {}", r.method, r.path, r.range.unwrap_or_default());
    }
    assert_eq!(server.downloads(), metadata_and(&[STORIES_SHARDS[1]]));
    assert_probe_then_body(&server.requests());
    assert!(!source.has_all_weights());

    // The balancer moves the node to block 4: only that block's shard comes.
    server.clear();
    let moved = BlockRange::new(4, 5);
    source
        .load_span_on(moved, &Placement::cpu_f32())
        .expect("load block 4");
    let moved_hashes = source.block_hashes(moved).expect("hash block 4");
    assert_eq!(server.downloads(), files(&[STORIES_SHARDS[2]]));

    // The same weights as the local directory, block by block, whatever the files they came in.
    let local = local_stories();
    assert_eq!(hashes, local.block_hashes(range).unwrap());
    assert_eq!(moved_hashes, local.block_hashes(moved).unwrap());
    // Named after the repository, pinned by the revision: not the local directory's content fingerprint.
    let id = source.model_id().unwrap();
    assert!(id.starts_with("petal-test-stories-sharded-"), "{id}");
    assert_ne!(id, local.model_id().unwrap());
    assert_eq!(
        snapshot_files(home.path(), REPO, COMMIT),
        metadata_and(&[STORIES_SHARDS[1], STORIES_SHARDS[2]])
    );
}

#[test]
fn a_client_fetches_only_the_head_and_a_cached_run_only_resolves_the_revision() {
    let server = stories_server();
    let home = tempfile::tempdir().unwrap();
    let cfg = config(&server.url, home.path());
    let source = open(REPO, &cfg);
    let head = source
        .load_head(Placement::cpu_f32())
        .expect("load the head");
    let tokenizer = source.tokenizer(None).expect("the tokenizer");
    assert_eq!(server.downloads(), metadata_and(&[STORIES_SHARDS[3]]));
    assert!(
        !source.has_all_weights(),
        "a client with the head only has not every shard"
    );

    // The head computes what the local directory's does.
    let local = local_stories();
    let local_tokenizer = local.tokenizer(None).unwrap();
    let ids = tokenizer.encode(PROMPT, true).unwrap();
    assert_eq!(ids, local_tokenizer.encode(PROMPT, true).unwrap());
    let local_head = local.load_head(Placement::cpu_f32()).unwrap();
    let hidden = head.embed(&ids).unwrap();
    let diff = (hidden.clone() - local_head.embed(&ids).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0, "the same embeddings");

    // A node of the same revision has the same model id.
    let node_home = tempfile::tempdir().unwrap();
    let node = open(REPO, &config(&server.url, node_home.path()));
    assert_eq!(node.model_id().unwrap(), source.model_id().unwrap());

    // Everything cached: the only request is the revision lookup (a branch may have moved); no file is asked for.
    server.clear();
    let again = open(REPO, &cfg);
    again.load_head(Placement::cpu_f32()).unwrap();
    assert_eq!(
        server.requests(),
        vec![HubRequest {
            method: "GET".into(),
            path: format!("/api/models/{REPO}/revision/main"),
            range: None,
            authorization: None,
        }]
    );
    assert_eq!(again.model_id().unwrap(), source.model_id().unwrap());

    // Offline (HF_HUB_OFFLINE) with the files cached: no request at all, the same model.
    server.clear();
    let offline = HubConfig {
        offline: true,
        ..cfg.clone()
    };
    let cached = open(REPO, &offline);
    cached.load_head(Placement::cpu_f32()).unwrap();
    assert_eq!(cached.model_id().unwrap(), source.model_id().unwrap());
    // ...but a block whose shard is not cached cannot be loaded, and the error says why.
    let err = cached
        .load_span_on(BlockRange::new(0, 1), &Placement::cpu_f32())
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, ModelError::HubOffline { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(STORIES_SHARDS[0]) && msg.contains("HF_HUB_OFFLINE") && msg.contains(REPO),
        "{msg}"
    );
    assert!(server.requests().is_empty(), "{:#?}", server.requests());

    // A pinned commit resolves too, to the same snapshot.
    server.clear();
    let pinned = open(&format!("{REPO}@{COMMIT}"), &cfg);
    assert_eq!(pinned.model_id().unwrap(), source.model_id().unwrap());
    assert!(server.downloads().is_empty());
}

#[test]
fn an_interrupted_download_resumes_where_it_stopped() {
    let repo = stories_sharded(REPO, COMMIT, &stories_hf());
    let shard = repo.files[STORIES_SHARDS[1]].clone();
    let server = HubServer::start(vec![repo]);
    let home = tempfile::tempdir().unwrap();
    // What an interrupted hf-hub download leaves: the first half of the blob as `<etag>.part`.
    let blobs = home
        .path()
        .join("hub/models--petal-test--stories-sharded/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let half = shard.len() / 2;
    std::fs::write(blobs.join(format!("{}.part", etag(&shard))), &shard[..half]).unwrap();

    let source = open(REPO, &config(&server.url, home.path()));
    source
        .load_span_on(BlockRange::new(2, 4), &Placement::cpu_f32())
        .unwrap();
    let bodies: Vec<HubRequest> = server
        .requests()
        .into_iter()
        .filter(|r| r.is_download() && r.file() == Some(STORIES_SHARDS[1]))
        .collect();
    assert_eq!(bodies.len(), 1, "{bodies:#?}");
    assert_eq!(bodies[0].range.as_deref(), Some(&*format!("bytes={half}-")));
    let on_disk = std::fs::read(source.path().join(STORIES_SHARDS[1])).unwrap();
    assert!(on_disk == *shard, "the resumed file is the shard");
    assert_eq!(
        source.block_hashes(BlockRange::new(2, 4)).unwrap(),
        local_stories().block_hashes(BlockRange::new(2, 4)).unwrap()
    );
}

#[test]
fn gguf_repositories_pick_one_file_by_name_or_quantization() {
    let server = HubServer::start(vec![gguf_repo(
        GGUF_REPO,
        GGUF_COMMIT,
        &smollm_gguf(),
        &["model-Q4_1.gguf", "model-Q8_0.gguf"],
    )]);
    let home = tempfile::tempdir().unwrap();
    let cfg = config(&server.url, home.path());

    // Two files and no choice: an error listing them, nothing downloaded.
    let msg = open_err(&ModelRef::parse(GGUF_REPO), &cfg).to_string();
    assert!(
        msg.contains("model-Q4_1.gguf")
            && msg.contains("model-Q8_0.gguf")
            && msg.contains("--gguf-file"),
        "{msg}"
    );
    assert!(server.downloads().is_empty(), "{:?}", server.downloads());

    // By quantization name, case-insensitively: that file only (no config or tokenizer in this repository).
    let q8 = open(&format!("{GGUF_REPO}:q8_0"), &cfg);
    assert_eq!(q8.format(), ModelFormat::Gguf);
    assert_eq!(q8.path().file_name().unwrap(), "model-Q8_0.gguf");
    assert_eq!(q8.spec().num_blocks, 30);
    assert_eq!(server.downloads(), files(&["model-Q8_0.gguf"]));
    assert!(q8.has_all_weights());

    // By file name (--gguf-file).
    server.clear();
    let by_name = ModelRef::parse(GGUF_REPO)
        .with_gguf_file(Some("model-Q4_1.gguf"))
        .unwrap();
    let mut q4 = hub::open(&by_name, &cfg).unwrap();
    q4.set_hash_cache(None);
    assert_eq!(q4.path().file_name().unwrap(), "model-Q4_1.gguf");
    assert_eq!(server.downloads(), files(&["model-Q4_1.gguf"]));
    assert_ne!(
        q4.model_id().unwrap(),
        q8.model_id().unwrap(),
        "different files are different models"
    );
    assert!(q4
        .model_id()
        .unwrap()
        .starts_with("petal-test-smollm-gguf-"));

    // Ambiguous or unmatched choices are errors naming the candidates.
    server.clear();
    let msg = open_err(&ModelRef::parse(&format!("{GGUF_REPO}:model")), &cfg).to_string();
    assert!(msg.contains("2 .gguf files"), "{msg}");
    let msg = open_err(&ModelRef::parse(&format!("{GGUF_REPO}:Q2_K")), &cfg).to_string();
    assert!(
        msg.contains("choose one of") && msg.contains("model-Q8_0.gguf"),
        "{msg}"
    );
    let by_missing_name = ModelRef::parse(GGUF_REPO)
        .with_gguf_file(Some("model-Q4_1"))
        .unwrap();
    let msg = open_err(&by_missing_name, &cfg).to_string();
    assert!(msg.contains("model-Q4_1.gguf"), "{msg}");
    assert!(server.downloads().is_empty());
}

#[test]
fn offline_with_an_empty_cache_is_a_clear_error() {
    let home = tempfile::tempdir().unwrap();
    let server = stories_server();
    let model = ModelRef::parse(REPO);

    // HF_HUB_OFFLINE: the hub is not asked.
    let offline = HubConfig {
        offline: true,
        ..config(&server.url, home.path())
    };
    let err = open_err(&model, &offline);
    assert!(matches!(err, ModelError::HubOffline { .. }), "{err:?}");
    let msg = err.to_string();
    for part in [
        REPO,
        "config.json",
        "HF_HUB_OFFLINE",
        "not in the Hugging Face cache",
    ] {
        assert!(
            msg.contains(part),
            "the error should mention {part:?}: {msg}"
        );
    }
    assert!(server.requests().is_empty());

    // No network: the endpoint refuses connections.
    let err = open_err(&model, &config(&refusing_endpoint(), home.path()));
    assert!(matches!(err, ModelError::HubOffline { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(REPO) && msg.contains("cannot be reached") && msg.contains("config.json"),
        "{msg}"
    );

    // A repository or revision the hub does not have is not an offline problem.
    let cfg = config(&server.url, home.path());
    let msg = open_err(&ModelRef::parse("petal-test/no-such-model"), &cfg).to_string();
    assert!(msg.contains("does not exist"), "{msg}");
    let msg = open_err(&ModelRef::parse(&format!("{REPO}@no-such-branch")), &cfg).to_string();
    assert!(msg.contains("does not exist"), "{msg}");
}

// ---------------------------------------------------------------------------------------------------------------
// The binaries

/// The environment pointing a process at `server` with its own cache under `home`.
fn hub_env(endpoint: &str, home: &Path) -> Vec<(String, String)> {
    vec![
        ("HF_ENDPOINT".into(), endpoint.into()),
        ("HF_HOME".into(), home.display().to_string()),
        (
            "HF_HUB_CACHE".into(),
            home.join("hub").display().to_string(),
        ),
        ("HF_HUB_OFFLINE".into(), String::new()),
    ]
}

fn pairs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

#[test]
fn nodes_and_client_from_the_hub_generate_like_the_local_directory() {
    let server = stories_server();
    let homes: Vec<tempfile::TempDir> = (0..5).map(|_| tempfile::tempdir().unwrap()).collect();
    let envs: Vec<Vec<(String, String)>> = homes
        .iter()
        .map(|h| hub_env(&server.url, h.path()))
        .collect();
    let swarm = Swarm::builder()
        .node_env(REPO, "0..2", &[], &pairs(&envs[0]))
        .node_env(REPO, "2..4", &[], &pairs(&envs[1]))
        .node_env(REPO, "4..5", &[], &pairs(&envs[2]))
        .start();
    let ids: BTreeSet<&str> = swarm.nodes.iter().map(|n| n.model_id.as_str()).collect();
    assert_eq!(ids.len(), 1, "one model id: {ids:?}");
    assert!(
        ids.iter()
            .all(|id| id.starts_with("petal-test-stories-sharded-")),
        "{ids:?}"
    );

    let mut generate = swarm.generate(REPO, PROMPT).max_new_tokens(32).ignore_eos();
    for (k, v) in &envs[3] {
        generate = generate.env(k, v);
    }
    // The client has a token (HF_TOKEN): its requests, and only its, carry it.
    generate = generate.env("HF_TOKEN", "hf_petal_test_token");
    let remote = generate.run_json();
    let local = Generate::new(stories_hf(), PROMPT)
        .local()
        .max_new_tokens(32)
        .ignore_eos()
        .run_json();
    eprintln!("local:  {:?}\nremote: {:?}", local.text, remote.text);
    assert_eq!(local.tokens.len(), 32);
    assert_same_tokens("hub swarm vs local directory", &remote, &local);

    // Each process's cache holds what its role read, and nothing else.
    let cached = |i: usize| snapshot_files(homes[i].path(), REPO, COMMIT);
    assert_eq!(cached(0), metadata_and(&[STORIES_SHARDS[0]]));
    assert_eq!(cached(1), metadata_and(&[STORIES_SHARDS[1]]));
    assert_eq!(cached(2), metadata_and(&[STORIES_SHARDS[2]]));
    assert_eq!(cached(3), metadata_and(&[STORIES_SHARDS[3]]));
    let with_token: Vec<HubRequest> = server
        .requests()
        .into_iter()
        .filter(|r| r.authorization.as_deref() == Some("Bearer hf_petal_test_token"))
        .collect();
    assert!(
        with_token.iter().any(|r| r.file().is_none()),
        "the revision lookup carries the token: {with_token:#?}"
    );
    let token_files: BTreeSet<String> = with_token
        .iter()
        .filter_map(|r| r.file().map(str::to_string))
        .collect();
    assert_eq!(token_files, metadata_and(&[STORIES_SHARDS[3]]));

    // The whole model in one process (`--local`) from the hub: every shard, the same tokens.
    let mut whole = Generate::new(REPO, PROMPT)
        .local()
        .max_new_tokens(32)
        .ignore_eos();
    for (k, v) in &envs[4] {
        whole = whole.env(k, v);
    }
    let whole = whole.run_json();
    assert_same_tokens("hub --local vs local directory", &whole, &local);
    assert_eq!(cached(4), metadata_and(&STORIES_SHARDS));
    assert!(!server
        .requests()
        .iter()
        .any(|r| r.file() == Some("index-is-not-a-model.txt")));
}

/// Runs `binary args` with `env`; it must fail quickly with an `error:` line containing every one of `expect`.
fn fails_with(binary: &str, args: &[&str], env: &[(String, String)], expect: &[&str]) {
    let mut cmd = Command::new(bin(binary));
    cmd.args(args);
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    let out = run_with_timeout(cmd, Duration::from_secs(60));
    eprintln!("{binary} {args:?}\n{out}\n");
    assert!(!out.success() && !out.timed_out(), "{out}");
    assert!(!out.stderr.contains("panicked"), "panicked\n{out}");
    let error = out
        .stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no `error:` line\n{out}"));
    for e in expect {
        assert!(error.contains(e), "the error should mention {e:?}: {error}");
    }
}

#[test]
fn the_binaries_explain_an_offline_start_with_nothing_cached() {
    let home = tempfile::tempdir().unwrap();
    let server = stories_server();
    let mut offline = hub_env(&server.url, home.path());
    offline.retain(|(k, _)| k != "HF_HUB_OFFLINE");
    offline.push(("HF_HUB_OFFLINE".into(), "1".into()));
    fails_with(
        "petal",
        &["generate", "--local", "--model", REPO, "--prompt", "hi"],
        &offline,
        &[REPO, "config.json", "HF_HUB_OFFLINE"],
    );
    fails_with(
        "petal-node",
        &[
            "serve", "--model", REPO, "--blocks", "0..2", "--listen", LISTEN,
        ],
        &hub_env(&refusing_endpoint(), home.path()),
        &[REPO, "cannot be reached"],
    );
    assert!(server.requests().is_empty());
}

/// The lazily opened shards change nothing for a local sharded directory: every shard must be there at open, and
/// the blocks are the single file's.
#[test]
fn a_local_sharded_directory_opens_as_before() {
    let repo = stories_sharded(REPO, COMMIT, &stories_hf());
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in &repo.files {
        std::fs::write(dir.path().join(name), bytes.as_slice()).unwrap();
    }
    let mut sharded = ModelSource::open(dir.path()).expect("a local sharded directory");
    sharded.set_hash_cache(None);
    assert!(sharded.has_all_weights() && sharded.hub().is_none());
    let all = BlockRange::new(0, 5);
    assert_eq!(
        sharded.block_hashes(all).unwrap(),
        local_stories().block_hashes(all).unwrap()
    );
    assert_eq!(sharded.weight_files().unwrap().len(), 4);

    std::fs::remove_file(dir.path().join(STORIES_SHARDS[2])).unwrap();
    match ModelSource::open(dir.path()) {
        Err(ModelError::NotFound(path)) => assert!(path.ends_with(STORIES_SHARDS[2])),
        other => panic!("a missing shard should fail the open: {other:?}"),
    }
}

/// A node without `--blocks` opens the model before it knows its span: it still downloads only the shards of the
/// blocks it then chooses.
#[test]
fn an_automatic_span_downloads_only_its_shards() {
    let server = stories_server();
    let home = tempfile::tempdir().unwrap();
    let env = hub_env(&server.url, home.path());
    let swarm = Swarm::builder()
        .node_env(REPO, "", &["--num-blocks", "2"], &pairs(&env))
        .start();
    let line = swarm.nodes[0]
        .proc
        .stdout
        .iter()
        .find(|l| l.starts_with("serving blocks "))
        .cloned()
        .expect("a serving line");
    let span = line["serving blocks ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    let (a, b) = span.split_once("..").unwrap();
    let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
    assert_eq!(b - a, 2, "{line}");
    let shard_of = |block: usize| STORIES_SHARDS[[0, 0, 1, 1, 2][block]];
    let shards: Vec<&str> = (a..b).map(shard_of).collect();
    assert_eq!(
        snapshot_files(home.path(), REPO, COMMIT),
        metadata_and(&shards),
        "{line}"
    );
}

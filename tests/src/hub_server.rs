//! A Hugging Face hub on loopback for the `--model org/name` tests: it serves repositories in the hub's URL layout
//! and records every request, so a test can assert exactly which files each role fetched.
//!
//! What it answers is what `hf-hub` (and `huggingface_hub`) ask:
//! - `GET /api/models/{org}/{name}/revision/{revision}`: `{"sha": commit, "siblings": [{"rfilename": ...}]}`;
//! - `GET /{org}/{name}/resolve/{revision}/{file}` with a `Range` header: `206 Partial Content` with
//!   `Content-Range`, `ETag` and `X-Repo-Commit` (hf-hub asks `bytes=0-0` first for the metadata, then
//!   `bytes=N-` for the body, N > 0 when it resumes a `.part` file).
//!
//! Unknown repositories, revisions and files are 404. One request per connection (`Connection: close`).
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// One repository at one commit.
#[derive(Clone, Debug)]
pub struct FakeRepo {
    /// `org/name`.
    pub id: String,
    /// 40 hex digits.
    pub commit: String,
    pub files: BTreeMap<String, Arc<Vec<u8>>>,
}

impl FakeRepo {
    pub fn new(id: &str, commit: &str) -> Self {
        FakeRepo {
            id: id.to_string(),
            commit: commit.to_string(),
            files: BTreeMap::new(),
        }
    }

    pub fn file(mut self, name: &str, bytes: impl Into<Arc<Vec<u8>>>) -> Self {
        self.files.insert(name.to_string(), bytes.into());
        self
    }
}

/// One request as the server saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubRequest {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    /// The `Authorization` header (`Bearer <HF_TOKEN>`).
    pub authorization: Option<String>,
}

impl HubRequest {
    /// The file of a `resolve` request (`None` for API calls).
    pub fn file(&self) -> Option<&str> {
        let rest = self.path.strip_prefix('/')?;
        let mut parts = rest.splitn(5, '/');
        let (_org, _name, resolve, _rev, file) = (
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
        );
        (resolve == "resolve").then_some(file)
    }

    /// A request for a file's body (not the `bytes=0-0` metadata probe).
    pub fn is_download(&self) -> bool {
        self.file().is_some() && self.range.as_deref() != Some("bytes=0-0")
    }
}

/// The server: a thread accepting connections on 127.0.0.1, one more per connection.
pub struct HubServer {
    pub url: String,
    requests: Arc<Mutex<Vec<HubRequest>>>,
    stop: Arc<AtomicBool>,
    port: u16,
    thread: Option<JoinHandle<()>>,
}

impl HubServer {
    pub fn start(repos: Vec<FakeRepo>) -> HubServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the hub server");
        let port = listener.local_addr().expect("local addr").port();
        let requests = Arc::new(Mutex::new(vec![]));
        let stop = Arc::new(AtomicBool::new(false));
        let repos: Arc<BTreeMap<String, FakeRepo>> =
            Arc::new(repos.into_iter().map(|r| (r.id.clone(), r)).collect());
        let thread = {
            let (requests, stop) = (requests.clone(), stop.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let (requests, repos) = (requests.clone(), repos.clone());
                    std::thread::spawn(move || {
                        let _ = serve(stream, &repos, &requests);
                    });
                }
            })
        };
        HubServer {
            url: format!("http://127.0.0.1:{port}"),
            requests,
            stop,
            port,
            thread: Some(thread),
        }
    }

    /// Every request so far, in order.
    pub fn requests(&self) -> Vec<HubRequest> {
        self.requests.lock().unwrap().clone()
    }

    /// Forgets the requests so far.
    pub fn clear(&self) {
        self.requests.lock().unwrap().clear();
    }

    /// The files whose bodies were requested so far.
    pub fn downloads(&self) -> BTreeSet<String> {
        self.requests()
            .iter()
            .filter(|r| r.is_download())
            .filter_map(|r| r.file().map(str::to_string))
            .collect()
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The URL of a port nothing listens on (connections are refused).
pub fn refusing_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

/// The ETag the server gives `bytes` (what hf-hub names the blob after).
pub fn etag(bytes: &[u8]) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{:016x}{:08x}", h.finish(), bytes.len())
}

fn serve(
    stream: TcpStream,
    repos: &BTreeMap<String, FakeRepo>,
    requests: &Mutex<Vec<HubRequest>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut words = line.split_whitespace();
    let (Some(method), Some(path)) = (words.next(), words.next()) else {
        return Ok(());
    };
    let (method, path) = (method.to_string(), path.to_string());
    let (mut range, mut authorization) = (None, None);
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = header.split_once(':') {
            if k.trim().eq_ignore_ascii_case("range") {
                range = Some(v.trim().to_string());
            }
            if k.trim().eq_ignore_ascii_case("authorization") {
                authorization = Some(v.trim().to_string());
            }
        }
    }
    requests.lock().unwrap().push(HubRequest {
        method: method.clone(),
        path: path.clone(),
        range: range.clone(),
        authorization,
    });
    let mut out = stream;
    let answer = answer(&path, range.as_deref(), repos);
    let (status, headers, body) = answer.unwrap_or_else(|| (404, vec![], b"not found".to_vec()));
    let reason = match status {
        200 => "OK",
        206 => "Partial Content",
        416 => "Range Not Satisfiable",
        _ => "Not Found",
    };
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes())?;
    if method != "HEAD" {
        out.write_all(&body)?;
    }
    out.flush()
}

type Answer = (u16, Vec<(&'static str, String)>, Vec<u8>);

fn answer(path: &str, range: Option<&str>, repos: &BTreeMap<String, FakeRepo>) -> Option<Answer> {
    let at = |repo: &FakeRepo, rev: &str| rev == "main" || rev == repo.commit;
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let (id, rev) = rest.split_once("/revision/")?;
        let repo = repos.get(id).filter(|r| at(r, rev))?;
        let siblings: Vec<serde_json::Value> = repo
            .files
            .keys()
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let body = serde_json::json!({ "id": repo.id, "sha": repo.commit, "siblings": siblings });
        return Some((
            200,
            vec![("Content-Type", "application/json".into())],
            body.to_string().into_bytes(),
        ));
    }
    let rest = path.strip_prefix('/')?;
    let mut parts = rest.splitn(5, '/');
    let (org, name, resolve, rev, file) = (
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
    );
    if resolve != "resolve" {
        return None;
    }
    let repo = repos.get(&format!("{org}/{name}")).filter(|r| at(r, rev))?;
    let bytes = repo.files.get(file)?;
    let len = bytes.len() as u64;
    let mut headers = vec![
        ("ETag", format!("\"{}\"", etag(bytes))),
        ("X-Repo-Commit", repo.commit.clone()),
        ("Accept-Ranges", "bytes".into()),
    ];
    let Some(spec) = range.and_then(|r| r.strip_prefix("bytes=")) else {
        return Some((200, headers, bytes.to_vec()));
    };
    let (a, b) = spec.split_once('-')?;
    let start: u64 = a.parse().ok()?;
    let end: u64 = match b {
        "" => len.saturating_sub(1),
        b => b.parse::<u64>().ok()?.min(len.saturating_sub(1)),
    };
    if start >= len || end < start {
        headers.push(("Content-Range", format!("bytes */{len}")));
        return Some((416, headers, vec![]));
    }
    headers.push(("Content-Range", format!("bytes {start}-{end}/{len}")));
    Some((206, headers, bytes[start as usize..=end as usize].to_vec()))
}

// -------------------------------------------------------------------------------------------------------------
// Repositories

/// The shards of [`stories_sharded`]: blocks 0-1, 2-3, 4, and the head (embeddings and final norm).
pub const STORIES_SHARDS: [&str; 4] = [
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors",
];

/// Which shard a stories260K tensor goes to.
fn stories_shard(tensor: &str) -> &'static str {
    let block = tensor
        .strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|b| b.parse::<usize>().ok());
    match block {
        Some(0 | 1) => STORIES_SHARDS[0],
        Some(2 | 3) => STORIES_SHARDS[1],
        Some(_) => STORIES_SHARDS[2],
        None => STORIES_SHARDS[3],
    }
}

/// stories260K (`hf` directory `dir`) as a sharded repository: config, tokenizer files, an index and the four
/// [`STORIES_SHARDS`], written from the single `model.safetensors`.
pub fn stories_sharded(id: &str, commit: &str, dir: &Path) -> FakeRepo {
    let whole = std::fs::read(dir.join("model.safetensors")).expect("read model.safetensors");
    let st = safetensors::SafeTensors::deserialize(&whole).expect("parse model.safetensors");
    let mut groups: BTreeMap<&str, Vec<(String, safetensors::tensor::TensorView)>> =
        BTreeMap::new();
    let mut weight_map = serde_json::Map::new();
    for (name, view) in st.tensors() {
        let shard = stories_shard(&name);
        weight_map.insert(name.clone(), shard.into());
        groups.entry(shard).or_default().push((name, view));
    }
    assert_eq!(groups.len(), 4, "stories260K splits into four shards");
    let index = serde_json::json!({
        "metadata": { "total_size": whole.len() },
        "weight_map": weight_map,
    });
    let mut repo = FakeRepo::new(id, commit)
        .file("index-is-not-a-model.txt", b"unrelated file".to_vec())
        .file(
            "model.safetensors.index.json",
            serde_json::to_vec_pretty(&index).unwrap(),
        );
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        repo = repo.file(f, std::fs::read(dir.join(f)).expect("read a metadata file"));
    }
    for (shard, tensors) in groups {
        let bytes = safetensors::serialize(tensors, None).expect("write a shard");
        repo = repo.file(shard, bytes);
    }
    repo
}

/// A GGUF repository holding `gguf` under each of `names` (the same bytes), plus a README.
pub fn gguf_repo(id: &str, commit: &str, gguf: &Path, names: &[&str]) -> FakeRepo {
    let bytes = Arc::new(std::fs::read(gguf).expect("read the GGUF"));
    let mut repo = FakeRepo::new(id, commit).file("README.md", b"# a GGUF repo\n".to_vec());
    for n in names {
        repo = repo.file(n, bytes.clone());
    }
    repo
}

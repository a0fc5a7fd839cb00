//! Models from the Hugging Face hub: `--model org/name[:QUANT][@revision]`.
//!
//! A model reference is a local path when one exists by that name (local wins), else a hub repository. Files go
//! into the standard Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`),
//! through the `hf-hub` crate: resumable `.part` downloads, blobs named by etag, `snapshots/<commit>/` links.
//!
//! Each role downloads only what it reads ([`open`]): config.json, the tokenizer files the repository has and the
//! safetensors index, then the shards holding the tensors it loads, fetched when it loads them: a node the shards
//! of its blocks (again when it moves to another span), a client the shards of the embeddings, final norm and LM
//! head. A single-file repository (`model.safetensors`, or one `.gguf` picked by [`GgufChoice`]) is that one file.
//!
//! A partly downloaded model cannot be fingerprinted from its bytes, so a hub model's id is pinned by the revision
//! instead: `<repo>-<sha256(spec, commit, index or file name)>`, the same on every peer that resolves the same
//! commit ([`crate::ModelSource::model_id`]).
mod progress;
mod repo;
mod select;

pub use progress::FetchProgress;
pub use repo::{HubConfig, HubRepo};
pub use select::GgufChoice;

use crate::compute::source::ModelSource;
use crate::error::{ModelError, Result};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

/// The safetensors index of a sharded repository.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The weights of a single-file repository.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Small files every role fetches when the repository has them: the description and the tokenizer's.
pub const METADATA_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
];

/// Where a model comes from: a path on this machine or a repository on the hub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelRef {
    Local(PathBuf),
    Hub(HubRef),
}

/// A repository on the hub, at a revision, and for GGUF repositories the file to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubRef {
    /// `org/name`.
    pub repo: String,
    /// A branch, tag or commit; `main` by default.
    pub revision: String,
    /// Which `.gguf` of a GGUF repository (`:QUANT` in the reference, or `--gguf-file`).
    pub gguf: Option<GgufChoice>,
}

impl ModelRef {
    /// Reads `s`: an existing path stays a path; `org/name[:QUANT][@revision]` names a hub repository; anything
    /// else is a path (which then fails to open as not found).
    pub fn parse(s: &str) -> ModelRef {
        if Path::new(s).exists() {
            return ModelRef::Local(PathBuf::from(s));
        }
        match HubRef::parse(s) {
            Some(hub) => ModelRef::Hub(hub),
            None => ModelRef::Local(PathBuf::from(s)),
        }
    }

    /// Picks the GGUF file `name` of a hub repository (`--gguf-file`). Errors for a local path, or when the
    /// reference already names a quantization.
    pub fn with_gguf_file(self, name: Option<&str>) -> Result<ModelRef> {
        let Some(name) = name else { return Ok(self) };
        match self {
            ModelRef::Local(p) => Err(ModelError::Hub(format!(
                "--gguf-file {name} picks a file of a hub repository, but {} is a local path",
                p.display()
            ))),
            ModelRef::Hub(HubRef {
                gguf: Some(GgufChoice::Quant(q)),
                ..
            }) => Err(ModelError::Hub(format!(
                "--gguf-file {name} and the quantization :{q} both pick the GGUF file; give one"
            ))),
            ModelRef::Hub(mut h) => {
                h.gguf = Some(GgufChoice::File(name.to_string()));
                Ok(ModelRef::Hub(h))
            }
        }
    }

    pub fn local_path(&self) -> Option<&Path> {
        match self {
            ModelRef::Local(p) => Some(p),
            ModelRef::Hub(_) => None,
        }
    }
}

impl HubRef {
    /// `org/name[:QUANT][@revision]`, or `None` when `s` does not look like one.
    pub fn parse(s: &str) -> Option<HubRef> {
        let (id, revision) = match s.split_once('@') {
            Some((id, rev)) => (id, Some(rev)),
            None => (s, None),
        };
        let (repo, quant) = match id.split_once(':') {
            Some((repo, q)) => (repo, Some(q)),
            None => (id, None),
        };
        let (org, name) = repo.split_once('/')?;
        if !valid_part(org) || !valid_part(name) {
            return None;
        }
        // A file name that does not exist is a missing local file, not a repository.
        let lower = name.to_ascii_lowercase();
        if [".gguf", ".bin", ".safetensors", ".json"]
            .iter()
            .any(|ext| lower.ends_with(ext))
        {
            return None;
        }
        let revision = match revision {
            Some(r) if valid_revision(r) => r.to_string(),
            Some(_) => return None,
            None => "main".to_string(),
        };
        let gguf = match quant {
            Some(q)
                if !q.is_empty() && q.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                Some(GgufChoice::Quant(q.to_string()))
            }
            Some(_) => return None,
            None => None,
        };
        Some(HubRef {
            repo: repo.to_string(),
            revision,
            gguf,
        })
    }
}

/// One part of `org/name`: the hub's characters, not starting with `.` or `-`, no `..`.
fn valid_part(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && !s.starts_with(['.', '-'])
        && !s.contains("..")
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A branch, tag or commit: git ref characters, no `..`, no leading `/`.
fn valid_revision(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && !s.starts_with(['/', '.', '-'])
        && !s.contains("..")
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

impl FromStr for ModelRef {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(ModelRef::parse(s))
    }
}

impl From<PathBuf> for ModelRef {
    fn from(p: PathBuf) -> Self {
        ModelRef::Local(p)
    }
}

impl From<&PathBuf> for ModelRef {
    fn from(p: &PathBuf) -> Self {
        ModelRef::Local(p.clone())
    }
}

impl From<&ModelRef> for ModelRef {
    fn from(m: &ModelRef) -> Self {
        m.clone()
    }
}

impl From<&Path> for ModelRef {
    fn from(p: &Path) -> Self {
        ModelRef::Local(p.to_path_buf())
    }
}

impl fmt::Display for ModelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelRef::Local(p) => write!(f, "{}", p.display()),
            ModelRef::Hub(h) => write!(f, "{h}"),
        }
    }
}

impl fmt::Display for HubRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.repo)?;
        if let Some(GgufChoice::Quant(q)) = &self.gguf {
            write!(f, ":{q}")?;
        }
        write!(f, "@{}", self.revision)?;
        if let Some(GgufChoice::File(name)) = &self.gguf {
            write!(f, " ({name})")?;
        }
        Ok(())
    }
}

/// What a model opened from the hub is pinned to: its identity ([`ModelSource::model_id`]) and whether every
/// weight file is here ([`ModelSource::has_all_weights`]).
#[derive(Debug, Clone)]
pub struct HubIdentity {
    pub repo: String,
    pub revision: String,
    /// The commit the revision resolved to.
    pub commit: String,
    /// The index's text (sharded), or the single weight file's name.
    pub layout: String,
    /// The weight files of this commit, and where they are (or will be) in the snapshot.
    pub weight_files: Vec<PathBuf>,
}

/// Opens `model`: a local path as [`ModelSource::open`] does, a hub repository through `config` (downloading the
/// metadata now and the weights as they are loaded).
pub fn open(model: &ModelRef, config: &HubConfig) -> Result<ModelSource> {
    match model {
        ModelRef::Local(path) => ModelSource::open(path),
        ModelRef::Hub(hub) => open_hub(hub, config),
    }
}

/// A path holding all of `model`: itself when local; for a hub repository, its snapshot directory (or GGUF file)
/// once every file of it is downloaded. For tools that hand the path on (the bench's node processes).
pub fn download_all(model: &ModelRef, config: &HubConfig) -> Result<PathBuf> {
    let hub = match model {
        ModelRef::Local(path) => return Ok(path.clone()),
        ModelRef::Hub(hub) => hub,
    };
    let (repo, layout) = resolve(hub, config)?;
    Ok(match layout {
        Layout::Sharded { shards, .. } => {
            for shard in &shards {
                repo.fetch(shard)?;
            }
            repo.snapshot_dir()
        }
        Layout::Single(_) => repo.snapshot_dir(),
        Layout::Gguf { path, .. } => path,
    })
}

/// What the weights of a repository are, with the small files already fetched.
enum Layout {
    /// `model.safetensors.index.json` (its text) and the shards it names.
    Sharded { text: String, shards: Vec<String> },
    /// `model.safetensors`, fetched.
    Single(PathBuf),
    /// One `.gguf`, fetched.
    Gguf { name: String, path: PathBuf },
}

/// Resolves the revision, fetches config, tokenizer files and the index (or the one weight file).
fn resolve(hub: &HubRef, config: &HubConfig) -> Result<(Arc<HubRepo>, Layout)> {
    let repo = Arc::new(HubRepo::connect(config, &hub.repo, &hub.revision)?);
    for file in METADATA_FILES {
        if repo.has(file) {
            repo.fetch(file)?;
        }
    }
    let ggufs: Vec<&str> = repo
        .files()
        .iter()
        .map(String::as_str)
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let layout = if hub.gguf.is_none() && repo.has(INDEX_FILE) {
        require_config(&repo)?;
        let index = repo.fetch(INDEX_FILE)?;
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let shards = crate::compute::weights::index_shards(&index, &text)?;
        Layout::Sharded { text, shards }
    } else if hub.gguf.is_none() && repo.has(SINGLE_FILE) {
        require_config(&repo)?;
        Layout::Single(repo.fetch(SINGLE_FILE)?)
    } else if !ggufs.is_empty() {
        let name = select::pick_gguf(&hub.repo, &ggufs, hub.gguf.as_ref())?;
        let path = repo.fetch(name)?;
        Layout::Gguf {
            name: name.to_string(),
            path,
        }
    } else if let Some(choice) = &hub.gguf {
        return Err(ModelError::Hub(format!(
            "{}@{} has no .gguf file to pick {choice} from",
            hub.repo, hub.revision
        )));
    } else {
        return Err(ModelError::Hub(format!(
            "{}@{} has no {INDEX_FILE}, {SINGLE_FILE} or .gguf file (files: {})",
            hub.repo,
            repo.commit(),
            repo.files().join(", ")
        )));
    };
    Ok((repo, layout))
}

fn open_hub(hub: &HubRef, config: &HubConfig) -> Result<ModelSource> {
    let (repo, layout) = resolve(hub, config)?;
    let dir = repo.snapshot_dir();
    let identity = |layout: String, weight_files: Vec<PathBuf>| HubIdentity {
        repo: hub.repo.clone(),
        revision: hub.revision.clone(),
        commit: repo.commit().to_string(),
        layout,
        weight_files,
    };
    let (source, id) = match layout {
        Layout::Sharded { text, shards } => {
            let fetcher = repo.clone();
            let fetch: crate::compute::weights::ShardFetch =
                Arc::new(move |file: &str| fetcher.fetch(file));
            let source = ModelSource::open_fetching(&dir, Some(fetch))?;
            let files = shards.iter().map(|s| dir.join(s)).collect();
            (source, identity(text, files))
        }
        Layout::Single(file) => (
            ModelSource::open(&dir)?,
            identity(SINGLE_FILE.to_string(), vec![file]),
        ),
        Layout::Gguf { name, path } => (ModelSource::open(&path)?, identity(name, vec![path])),
    };
    tracing::info!(repo = %hub.repo, revision = %hub.revision, commit = %repo.commit(), "opened a hub model");
    Ok(source.pinned_to(id))
}

fn require_config(repo: &HubRepo) -> Result<()> {
    if repo.has("config.json") {
        return Ok(());
    }
    Err(ModelError::Hub(format!(
        "{} has safetensors weights but no config.json",
        repo.name()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse() {
        let h = |s: &str| match ModelRef::parse(s) {
            ModelRef::Hub(h) => h,
            other => panic!("{s} parsed as {other:?}"),
        };
        assert_eq!(
            h("org/name"),
            HubRef {
                repo: "org/name".into(),
                revision: "main".into(),
                gguf: None
            }
        );
        assert_eq!(h("org/name@v1.0").revision, "v1.0");
        assert_eq!(h("org/name@refs/pr/1").revision, "refs/pr/1");
        let q = h("TheOrg/Some-Model_1.5B-GGUF:Q4_K_M@abc123");
        assert_eq!(q.repo, "TheOrg/Some-Model_1.5B-GGUF");
        assert_eq!(q.revision, "abc123");
        assert_eq!(q.gguf, Some(GgufChoice::Quant("Q4_K_M".into())));
        for local in [
            "/abs/path",
            "./rel/path",
            "model.gguf",
            "dir/model.gguf",
            "a/b/c",
            "org/",
            "/org/name",
            "org/..",
            "org/name@",
            "org/name@../x",
            "org/name:",
            "org/na me",
        ] {
            assert!(
                matches!(ModelRef::parse(local), ModelRef::Local(_)),
                "{local} should be a path"
            );
        }
    }

    #[test]
    fn an_existing_path_wins() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("org/name")).unwrap();
        let cwd_relative = dir.path().join("org/name");
        let s = cwd_relative.to_str().unwrap();
        assert_eq!(ModelRef::parse(s), ModelRef::Local(cwd_relative.clone()));
    }

    #[test]
    fn gguf_file_flag() {
        let r = ModelRef::parse("org/name")
            .with_gguf_file(Some("m-Q8_0.gguf"))
            .unwrap();
        assert!(matches!(
            r,
            ModelRef::Hub(HubRef {
                gguf: Some(GgufChoice::File(_)),
                ..
            })
        ));
        assert!(ModelRef::parse("org/name:Q4_1")
            .with_gguf_file(Some("x.gguf"))
            .is_err());
        assert!(ModelRef::parse("/no/such.gguf")
            .with_gguf_file(Some("x.gguf"))
            .is_err());
    }
}

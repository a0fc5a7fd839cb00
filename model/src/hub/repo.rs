//! One repository at one resolved commit: its file list, and each file from the cache or downloaded into it.
use super::progress::{FetchProgress, Forward};
use crate::error::{ModelError, Result};
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where and how to reach the hub. [`HubConfig::from_env`] reads the variables the Hugging Face tools read:
/// `HF_ENDPOINT`, `HF_HOME` / `HF_HUB_CACHE`, `HF_TOKEN` (else the token file `$HF_HOME/token`) and
/// `HF_HUB_OFFLINE`.
#[derive(Clone)]
pub struct HubConfig {
    /// The hub's base URL (`$HF_ENDPOINT`, else https://huggingface.co).
    pub endpoint: String,
    /// The cache's `hub` directory; `None` when no home directory is known (then only local paths open).
    pub cache_dir: Option<PathBuf>,
    /// Bearer token for gated and private repositories.
    pub token: Option<String>,
    /// Never touch the network: use what the cache holds (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
    /// Where download progress goes (the CLIs draw bars); `None`: logged only.
    pub progress: Option<Arc<dyn FetchProgress>>,
}

impl std::fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubConfig")
            .field("endpoint", &self.endpoint)
            .field("cache_dir", &self.cache_dir)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("offline", &self.offline)
            .finish()
    }
}

impl Default for HubConfig {
    /// [`HubConfig::from_env`].
    fn default() -> Self {
        Self::from_env()
    }
}

fn env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

impl HubConfig {
    /// The configuration the environment describes, as `huggingface_hub` reads it.
    pub fn from_env() -> Self {
        let hf_home = env("HF_HOME").map(PathBuf::from).or_else(|| {
            env("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .map(|c| c.join("huggingface"))
        });
        let cache_dir = env("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| hf_home.as_ref().map(|h| h.join("hub")));
        let token_file = env("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .or_else(|| hf_home.as_ref().map(|h| h.join("token")));
        let token = env("HF_TOKEN")
            .or_else(|| env("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let text = std::fs::read_to_string(token_file?).ok()?;
                Some(text.trim().to_string()).filter(|t| !t.is_empty())
            });
        let offline = env("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        Self {
            endpoint: env("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()),
            cache_dir,
            token,
            offline,
            progress: None,
        }
    }

    /// The same configuration, reporting download progress to `progress`.
    pub fn with_progress(mut self, progress: Arc<dyn FetchProgress>) -> Self {
        self.progress = Some(progress);
        self
    }
}

/// A repository at the commit its revision resolved to.
pub struct HubRepo {
    name: String,
    revision: String,
    commit: String,
    files: Vec<String>,
    endpoint: String,
    cache_dir: PathBuf,
    /// `None` offline (`HF_HUB_OFFLINE`): only cached files.
    api: Option<Api>,
    progress: Option<Arc<dyn FetchProgress>>,
}

impl std::fmt::Debug for HubRepo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubRepo")
            .field("name", &self.name)
            .field("revision", &self.revision)
            .field("commit", &self.commit)
            .finish()
    }
}

impl HubRepo {
    /// Resolves `revision` of `name`: online, one API request (`GET /api/models/{name}/revision/{revision}`)
    /// gives the commit and the file list, and the cache records `refs/{revision}`; offline, or when the hub
    /// cannot be reached, the cache's ref and snapshot answer instead.
    pub fn connect(config: &HubConfig, name: &str, revision: &str) -> Result<Self> {
        let cache_dir = config.cache_dir.clone().ok_or_else(|| {
            ModelError::Hub(format!(
                "no Hugging Face cache directory for {name}: set HF_HOME (or HOME)"
            ))
        })?;
        let mut repo = Self {
            name: name.to_string(),
            revision: revision.to_string(),
            commit: String::new(),
            files: vec![],
            endpoint: config.endpoint.clone(),
            cache_dir,
            api: None,
            progress: config.progress.clone(),
        };
        if config.offline {
            repo.resolve_from_cache("HF_HUB_OFFLINE is set: the hub is not asked")?;
            return Ok(repo);
        }
        let api = ApiBuilder::from_cache(Cache::new(repo.cache_dir.clone()))
            .with_endpoint(config.endpoint.clone())
            .with_token(config.token.clone())
            .with_progress(false)
            .with_retries(2)
            .build()
            .map_err(|e| ModelError::Hub(format!("cannot set up the hub client: {e}")))?;
        let info = guard(|| api.repo(repo.hf_repo(revision)).info());
        match info {
            Ok(info) => {
                repo.commit = checked_commit(&info.sha)?;
                repo.files = info.siblings.into_iter().map(|s| s.rfilename).collect();
                if repo.commit != revision {
                    let cache = Cache::new(repo.cache_dir.clone());
                    if let Err(e) = cache.repo(repo.hf_repo(revision)).create_ref(&repo.commit) {
                        tracing::warn!(repo = %name, error = %e, "cannot record the revision's commit in the cache");
                    }
                }
                tracing::info!(repo = %name, %revision, commit = %repo.commit, files = repo.files.len(), "resolved on the hub");
            }
            Err(e) if unreachable(&e) => {
                let reason = format!(
                    "the hub at {} cannot be reached ({e}); check the network or HF_ENDPOINT",
                    repo.endpoint
                );
                tracing::warn!(repo = %name, %reason, "using the Hugging Face cache");
                repo.resolve_from_cache(&reason)?;
            }
            Err(e) => return Err(repo.request_error(None, e)),
        }
        repo.api = Some(api);
        Ok(repo)
    }

    /// `org/name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The commit the revision resolved to.
    pub fn commit(&self) -> &str {
        &self.commit
    }

    /// The repository's files (offline: those in the cached snapshot).
    pub fn files(&self) -> &[String] {
        &self.files
    }

    pub fn has(&self, file: &str) -> bool {
        self.files.iter().any(|f| f == file)
    }

    /// `<cache>/models--org--name/snapshots/<commit>`: where this commit's files are.
    pub fn snapshot_dir(&self) -> PathBuf {
        self.repo_dir().join("snapshots").join(&self.commit)
    }

    /// `file` of this commit: from the cache, else downloaded into it (resuming a partial download).
    pub fn fetch(&self, file: &str) -> Result<PathBuf> {
        if !safe_relative(file) {
            return Err(ModelError::Hub(format!(
                "{} names the file {file:?}, which is not a plain path inside the repository",
                self.name
            )));
        }
        let path = self.snapshot_dir().join(file);
        if path.is_file() {
            tracing::debug!(repo = %self.name, file, "in the cache");
            return Ok(path);
        }
        let Some(api) = &self.api else {
            return Err(self.offline_error(file, "HF_HUB_OFFLINE is set: the hub is not asked"));
        };
        tracing::info!(repo = %self.name, commit = %self.commit, file, "downloading");
        let got = loop {
            let progress = Forward {
                file: file.to_string(),
                sink: self.progress.as_deref(),
            };
            let attempt = guard(|| {
                api.repo(self.hf_repo(&self.commit))
                    .download_with_progress(file, progress)
            });
            match attempt {
                // Another process sharing the cache is downloading this blob (hf-hub tried its lock for 5 s):
                // wait for its result rather than fail; if it dies, its lock goes and this one resumes its part.
                Err(ApiError::LockAcquisition(_)) if !path.is_file() => {
                    tracing::info!(repo = %self.name, file, "another process is downloading this file; waiting");
                }
                Err(ApiError::LockAcquisition(_)) => break path.clone(),
                other => break other.map_err(|e| self.request_error(Some(file), e))?,
            }
        };
        if got != path {
            return Err(ModelError::Hub(format!(
                "the hub answered {} for {file} of {}@{}, not that commit",
                got.display(),
                self.name,
                self.commit
            )));
        }
        Ok(path)
    }

    fn hf_repo(&self, revision: &str) -> Repo {
        Repo::with_revision(self.name.clone(), RepoType::Model, revision.to_string())
    }

    fn repo_dir(&self) -> PathBuf {
        self.cache_dir
            .join(Repo::model(self.name.clone()).folder_name())
    }

    /// The commit from `refs/{revision}` (or a snapshot named by the revision itself), and the snapshot's files.
    fn resolve_from_cache(&mut self, reason: &str) -> Result<()> {
        let dir = self.repo_dir();
        let from_ref = std::fs::read_to_string(dir.join("refs").join(&self.revision))
            .ok()
            .map(|c| c.trim().to_string());
        let commit = match from_ref {
            Some(c) => checked_commit(&c)?,
            None if dir.join("snapshots").join(&self.revision).is_dir() => {
                checked_commit(&self.revision)?
            }
            None => return Err(self.offline_error("config.json", reason)),
        };
        self.commit = commit;
        let snapshot = self.snapshot_dir();
        let entries = std::fs::read_dir(&snapshot).map_err(|e| ModelError::io(&snapshot, e))?;
        let mut files: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_file())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        files.sort();
        tracing::info!(repo = %self.name, revision = %self.revision, commit = %self.commit, files = files.len(), "resolved from the cache");
        self.files = files;
        Ok(())
    }

    fn offline_error(&self, file: &str, reason: &str) -> ModelError {
        ModelError::HubOffline {
            repo: format!("{}@{}", self.name, self.revision),
            file: file.to_string(),
            cache: self.cache_dir.clone(),
            reason: reason.to_string(),
        }
    }

    /// A failed request as a [`ModelError`]: unreachable is [`ModelError::HubOffline`]; statuses say what they
    /// mean for this repository.
    fn request_error(&self, file: Option<&str>, e: ApiError) -> ModelError {
        if unreachable(&e) {
            let reason = format!(
                "the hub at {} cannot be reached ({e}); check the network or HF_ENDPOINT",
                self.endpoint
            );
            return self.offline_error(file.unwrap_or("config.json"), &reason);
        }
        let what = match file {
            Some(f) => format!("{f} of {}@{}", self.name, self.revision),
            None => format!("{}@{}", self.name, self.revision),
        };
        match status(&e) {
            Some(404) => ModelError::Hub(format!(
                "{what} does not exist on {} (and no local path of that name does)",
                self.endpoint
            )),
            Some(401 | 403) => ModelError::Hub(format!(
                "{what} on {} is private, gated or missing: set HF_TOKEN to a token with access",
                self.endpoint
            )),
            _ => ModelError::Hub(format!("{what} from {}: {e}", self.endpoint)),
        }
    }
}

/// Runs an hf-hub call, turning a panic inside it (it unwraps some of the server's answers) into an error.
fn guard<T>(
    f: impl FnOnce() -> std::result::Result<T, ApiError>,
) -> std::result::Result<T, ApiError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(ApiError::IoError(std::io::Error::other(
            "the hub client failed on a malformed answer",
        )))
    })
}

fn status(e: &ApiError) -> Option<u16> {
    match e {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            ureq::Error::Transport(_) => None,
        },
        ApiError::TooManyRetries(inner) => status(inner),
        _ => None,
    }
}

/// Whether the error is the network's (no answer at all), not the hub's.
fn unreachable(e: &ApiError) -> bool {
    match e {
        ApiError::RequestError(e) => matches!(e.as_ref(), ureq::Error::Transport(_)),
        ApiError::TooManyRetries(inner) => unreachable(inner),
        _ => false,
    }
}

/// A commit as the hub names it (hex, or at least path-safe), since it becomes a directory name.
fn checked_commit(c: &str) -> Result<String> {
    if !c.is_empty() && c.len() <= 64 && c.chars().all(|ch| ch.is_ascii_alphanumeric()) {
        return Ok(c.to_string());
    }
    Err(ModelError::Hub(format!(
        "the hub named the commit {c:?}, which is not a commit hash"
    )))
}

/// A relative path of plain components (no `..`, no root): safe to join under the snapshot.
fn safe_relative(file: &str) -> bool {
    !file.is_empty()
        && !file.contains('\\')
        && Path::new(file)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

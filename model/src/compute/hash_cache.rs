//! A disk cache of block hashes ([`crate::ModelSource::block_hashes`]), so that a node restarting, or a client
//! starting, over a model of hundreds of GB does not read all of it again. Entries are keyed by the model id
//! (which samples every tensor) and the path, size and modification time of every weight file: replacing or
//! editing a file invalidates them. (A file changed in place that keeps its size and time to the nanosecond, say by
//! bit rot, is not noticed; delete the cache directory to rehash.)
use crate::error::{ModelError, Result};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// The cache of one model's files.
#[derive(Debug, Clone)]
pub struct HashCache {
    file: PathBuf,
    model_id: String,
}

/// What a cache file holds.
#[derive(serde::Serialize, serde::Deserialize)]
struct Entry {
    model_id: String,
    /// Block index to hash (hex SHA-256).
    blocks: BTreeMap<usize, String>,
}

impl HashCache {
    /// Where caches live: `$PETAL_CACHE_DIR`, else `$XDG_CACHE_HOME/petal`, else `$HOME/.cache/petal`; `None`
    /// when none of them is set (no cache).
    pub fn default_dir() -> Option<PathBuf> {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        var("PETAL_CACHE_DIR")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("petal")))
            .or_else(|| var("HOME").map(|d| d.join(".cache").join("petal")))
    }

    /// The cache for `model_id` stored in `files`, under `dir`.
    pub fn for_model(dir: &Path, model_id: &str, files: &[PathBuf]) -> Result<Self> {
        let mut key = Sha256::new();
        key.update(b"petal-block-hashes-v1\0");
        key.update(model_id.as_bytes());
        for file in files {
            let meta = std::fs::metadata(file).map_err(|e| ModelError::io(file, e))?;
            let modified = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            let path = std::fs::canonicalize(file).unwrap_or_else(|_| file.clone());
            key.update(path.to_string_lossy().as_bytes());
            key.update(meta.len().to_le_bytes());
            key.update(modified.to_le_bytes());
        }
        let name = format!("{}.json", hex::encode(key.finalize()));
        Ok(Self {
            file: dir.join("block-hashes").join(name),
            model_id: model_id.to_string(),
        })
    }

    /// The hashes known so far; none when the cache is missing or unreadable (it is only a cache).
    pub fn load(&self) -> BTreeMap<usize, String> {
        let Ok(bytes) = std::fs::read(&self.file) else {
            return BTreeMap::new();
        };
        match serde_json::from_slice::<Entry>(&bytes) {
            Ok(entry) if entry.model_id == self.model_id => entry
                .blocks
                .into_iter()
                .filter(|(_, h)| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                .collect(),
            Ok(_) => BTreeMap::new(),
            Err(e) => {
                tracing::debug!(file = %self.file.display(), error = %e, "ignoring an unreadable block hash cache");
                BTreeMap::new()
            }
        }
    }

    /// Writes `blocks` (best effort: a cache that cannot be written is skipped with a warning). The file is
    /// replaced atomically, so a reader never sees half of it.
    pub fn store(&self, blocks: &BTreeMap<usize, String>) {
        let entry = Entry {
            model_id: self.model_id.clone(),
            blocks: blocks.clone(),
        };
        let write = || -> std::io::Result<()> {
            let dir = self.file.parent().unwrap_or(Path::new("."));
            std::fs::create_dir_all(dir)?;
            let tmp = self
                .file
                .with_extension(format!("tmp-{}", std::process::id()));
            std::fs::write(&tmp, serde_json::to_vec(&entry)?)?;
            std::fs::rename(&tmp, &self.file)
        };
        if let Err(e) = write() {
            tracing::warn!(file = %self.file.display(), error = %e, "cannot write the block hash cache; hashes will be computed again next time");
        }
    }

    /// The cache file.
    pub fn path(&self) -> &Path {
        &self.file
    }
}

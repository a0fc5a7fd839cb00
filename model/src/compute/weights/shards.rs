//! The safetensors files of one model, each memory-mapped when a tensor in it is first asked for. With an index
//! (`model.safetensors.index.json`) the tensor-to-file map comes from its `weight_map`, so a shard that is not on
//! disk yet can be fetched then ([`ShardFetch`]: a hub model downloads only the shards of what it loads).
use crate::error::{ModelError, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{Device, Tensor};
use safetensors::tensor::TensorView;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Brings a shard (its file name in the index) onto disk and returns its path.
pub type ShardFetch = Arc<dyn Fn(&str) -> Result<PathBuf> + Send + Sync>;

struct Shard {
    /// The file name in the index.
    name: String,
    path: PathBuf,
    st: OnceLock<MmapedSafetensors>,
}

pub(crate) struct Shards {
    shards: Vec<Shard>,
    /// Tensor name to shard.
    map: BTreeMap<String, usize>,
    fetch: Option<ShardFetch>,
    /// Held while a shard is fetched and opened: each is fetched once.
    opening: Mutex<()>,
}

/// The distinct shard file names an index's `weight_map` names, sorted.
pub fn index_shards(index: &Path, text: &str) -> Result<Vec<String>> {
    Ok(weight_map(index, text)?
        .into_values()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect())
}

fn weight_map(index: &Path, text: &str) -> Result<BTreeMap<String, String>> {
    let corrupt = |reason: String| ModelError::Corrupt {
        format: "safetensors index",
        path: index.to_path_buf(),
        reason,
    };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| corrupt(e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| corrupt("no weight_map object".into()))?;
    map.iter()
        .map(|(tensor, file)| match file.as_str() {
            Some(f) if !f.is_empty() => Ok((tensor.clone(), f.to_string())),
            _ => Err(corrupt(format!(
                "tensor {tensor:?} maps to {file}, not a file name"
            ))),
        })
        .collect()
}

impl Shards {
    /// One file, opened now.
    pub(crate) fn single(path: &Path) -> Result<Self> {
        let shard = Shard {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            path: path.to_path_buf(),
            st: OnceLock::new(),
        };
        let mut shards = Self {
            shards: vec![shard],
            map: BTreeMap::new(),
            fetch: None,
            opening: Mutex::new(()),
        };
        let names: Vec<String> = shards
            .open(0)?
            .tensors()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        shards.map = names.into_iter().map(|n| (n, 0)).collect();
        Ok(shards)
    }

    /// The shards `index` (in `dir`) names. Without `fetch` every shard must be on disk, and is opened now; with
    /// it, each is opened (and fetched if missing) when first needed.
    pub(crate) fn indexed(dir: &Path, index: &Path, fetch: Option<ShardFetch>) -> Result<Self> {
        let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
        let map = weight_map(index, &text)?;
        let names: Vec<String> = map
            .values()
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let shards: Vec<Shard> = names
            .iter()
            .map(|name| Shard {
                name: name.clone(),
                path: dir.join(name),
                st: OnceLock::new(),
            })
            .collect();
        let position: BTreeMap<&str, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let map = map
            .iter()
            .filter_map(|(t, f)| Some((t.clone(), *position.get(f.as_str())?)))
            .collect();
        let lazy = fetch.is_some();
        let this = Self {
            shards,
            map,
            fetch,
            opening: Mutex::new(()),
        };
        if !lazy {
            for s in &this.shards {
                if !s.path.exists() {
                    return Err(ModelError::NotFound(s.path.clone()));
                }
            }
            for i in 0..this.shards.len() {
                this.open(i)?;
            }
        }
        Ok(this)
    }

    /// Where each shard is (or will be, once fetched).
    pub(crate) fn files(&self) -> Vec<PathBuf> {
        self.shards.iter().map(|s| s.path.clone()).collect()
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// Every tensor's name, from the headers and the index alone (nothing is fetched).
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// Tensor `name`'s view, opening (fetching) its shard if needed.
    pub(crate) fn get(&self, name: &str) -> Result<TensorView<'_>> {
        let missing = || ModelError::MissingTensor { name: name.into() };
        let &i = self.map.get(name).ok_or_else(missing)?;
        self.open(i)?.get(name).map_err(|_| missing())
    }

    pub(crate) fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let &i = self
            .map
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        Ok(self.open(i)?.load(name, device)?)
    }

    /// Every tensor (opening every shard).
    pub(crate) fn tensors(&self) -> Result<Vec<(String, TensorView<'_>)>> {
        self.tensors_where(|_| true)
    }

    /// The tensors whose names satisfy `keep`, opening only the shards that hold them.
    pub(crate) fn tensors_where(
        &self,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Vec<(String, TensorView<'_>)>> {
        let mut out = vec![];
        for (name, _) in self.map.iter().filter(|(n, _)| keep(n)) {
            out.push((name.clone(), self.get(name)?));
        }
        Ok(out)
    }

    /// [`Self::tensors_where`], or `None` when a shard holding one of them is not on disk yet (a hub model's, which
    /// only loading should fetch).
    pub(crate) fn local_tensors_where(
        &self,
        keep: impl Fn(&str) -> bool,
    ) -> Option<Vec<(String, TensorView<'_>)>> {
        let local = self
            .map
            .iter()
            .filter(|(n, _)| keep(n))
            .all(|(_, &i)| self.shards[i].st.get().is_some() || self.shards[i].path.is_file());
        local.then(|| self.tensors_where(keep).ok()).flatten()
    }

    fn open(&self, i: usize) -> Result<&MmapedSafetensors> {
        let shard = &self.shards[i];
        if let Some(st) = shard.st.get() {
            return Ok(st);
        }
        let _one_at_a_time = self.opening.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = shard.st.get() {
            return Ok(st);
        }
        let path = match &self.fetch {
            Some(fetch) if !shard.path.is_file() => fetch(&shard.name)?,
            _ => shard.path.clone(),
        };
        if !path.exists() {
            return Err(ModelError::NotFound(path));
        }
        // SAFETY: the file is opened read-only; as with every mmap, truncating it while we run is undefined.
        let st = unsafe { MmapedSafetensors::new(&path) }.map_err(|e| ModelError::Corrupt {
            format: "safetensors",
            path: path.clone(),
            reason: e.to_string(),
        })?;
        tracing::debug!(shard = %shard.name, "opened a safetensors shard");
        Ok(shard.st.get_or_init(|| st))
    }
}

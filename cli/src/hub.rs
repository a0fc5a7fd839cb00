//! `--model org/name[@revision]` in the binaries: the hub configuration from the environment (`HF_ENDPOINT`,
//! `HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE`) with a progress bar per downloaded file on stderr (hidden when stderr
//! is not a terminal).
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use petal_model::hub::{self, FetchProgress, HubConfig, ModelRef};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The environment's hub configuration, drawing download bars (in `group` when given).
pub fn config(group: Option<&MultiProgress>) -> HubConfig {
    HubConfig::from_env().with_progress(Arc::new(Bars {
        group: group.cloned(),
        bars: Mutex::new(HashMap::new()),
    }))
}

/// `model` with `--gguf-file` applied.
pub fn model_ref(model: &ModelRef, gguf_file: Option<&str>) -> anyhow::Result<ModelRef> {
    Ok(model.clone().with_gguf_file(gguf_file)?)
}

/// A local path holding all of `model` (downloading every file of a hub model first): for tools that hand the
/// path on, such as the bench.
pub fn local_path(model: &ModelRef) -> anyhow::Result<PathBuf> {
    Ok(hub::download_all(model, &config(None))?)
}

/// One bar per file being downloaded.
struct Bars {
    group: Option<MultiProgress>,
    bars: Mutex<HashMap<String, ProgressBar>>,
}

impl FetchProgress for Bars {
    fn init(&self, file: &str, size: u64) {
        let mut bars = self.bars.lock().unwrap_or_else(|e| e.into_inner());
        let bar = bars.entry(file.to_string()).or_insert_with(|| {
            let bar = ProgressBar::new(size)
                .with_style(
                    ProgressStyle::with_template(
                        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
                )
                .with_message(format!("downloading {file}"));
            match &self.group {
                Some(g) => g.add(bar),
                None => bar,
            }
        });
        bar.set_length(size);
        bar.set_position(0);
    }

    fn update(&self, file: &str, bytes: u64) {
        let bars = self.bars.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bar) = bars.get(file) {
            bar.inc(bytes);
        }
    }

    fn finish(&self, file: &str) {
        let mut bars = self.bars.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bar) = bars.remove(file) {
            bar.finish_and_clear();
        }
    }
}

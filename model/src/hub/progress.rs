//! Download progress: the library reports it through [`FetchProgress`] (and `tracing`); the CLIs draw bars.

/// Receives the progress of each file download. Called from the downloading thread.
pub trait FetchProgress: Send + Sync {
    /// A download of `file` of `size` bytes starts (again, after a retry: the position restarts from the bytes
    /// already on disk, reported by [`FetchProgress::update`]).
    fn init(&self, file: &str, size: u64);
    /// `bytes` more of `file` are on disk.
    fn update(&self, file: &str, bytes: u64);
    /// `file` is complete.
    fn finish(&self, file: &str);
}

/// hf-hub's progress hook, forwarding to a [`FetchProgress`] (if any) and logging.
pub(crate) struct Forward<'a> {
    pub(crate) file: String,
    pub(crate) sink: Option<&'a dyn FetchProgress>,
}

impl hf_hub::api::Progress for Forward<'_> {
    fn init(&mut self, size: usize, _filename: &str) {
        tracing::debug!(file = %self.file, bytes = size, "download starts");
        if let Some(s) = self.sink {
            s.init(&self.file, size as u64);
        }
    }

    fn update(&mut self, size: usize) {
        if let Some(s) = self.sink {
            s.update(&self.file, size as u64);
        }
    }

    fn finish(&mut self) {
        if let Some(s) = self.sink {
            s.finish(&self.file);
        }
    }
}

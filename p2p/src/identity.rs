//! The node's long-lived ed25519 identity, kept in a file so its peer id (and therefore its DHT keys and the
//! addresses clients have cached) survives restarts.
//!
//! The file holds `Keypair::to_protobuf_encoding`, the libp2p-standard format, so other libp2p tools can read it.

use std::{fs, io::Write, path::Path};

use libp2p::{identity::Keypair, PeerId};

use crate::NetError;

fn identity_error(path: &Path, reason: impl std::fmt::Display) -> NetError {
    NetError::Identity {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Generates a fresh ed25519 key and writes it to `path` with mode 0600.
///
/// Refuses to overwrite an existing file: silently replacing a key would change the node's peer id and orphan
/// everything announced under the old one. Parent directories are created if missing.
pub fn generate_to_file(path: &Path) -> Result<PeerId, NetError> {
    let keypair = Keypair::generate_ed25519();
    let bytes = keypair
        .to_protobuf_encoding()
        .map_err(|e| identity_error(path, format!("cannot encode key: {e}")))?;
    write_secret_file(path, &bytes, "an identity key")
        .map_err(|reason| identity_error(path, reason))?;
    let peer_id = keypair.public().to_peer_id();
    tracing::info!(path = %path.display(), %peer_id, "generated new identity key");
    Ok(peer_id)
}

/// Writes `bytes` to a new file at `path` with mode 0600, creating parent directories. Refuses to overwrite an
/// existing file (`what` names the secret in that error). Errors are reasons, for the caller's typed error.
pub(crate) fn write_secret_file(path: &Path, bytes: &[u8], what: &str) -> Result<(), String> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| format!("cannot create directory: {e}"))?;
    }
    let mut options = fs::OpenOptions::new();
    // create_new: fail (rather than truncate) if the file exists; checked atomically by the OS.
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            format!("already exists; refusing to overwrite {what}")
        } else {
            e.to_string()
        }
    })?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| format!("cannot write: {e}"))
}

/// Loads a key written by [`generate_to_file`].
pub fn load_from_file(path: &Path) -> Result<Keypair, NetError> {
    let bytes = fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            identity_error(path, "no such file (generate one first)")
        } else {
            identity_error(path, e)
        }
    })?;
    let keypair = Keypair::from_protobuf_encoding(&bytes)
        .map_err(|e| identity_error(path, format!("not a valid libp2p key file: {e}")))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path = %path.display(), "identity key is readable by other users; chmod 600 it");
            }
        }
    }
    Ok(keypair)
}

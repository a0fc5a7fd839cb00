//! Private swarms: a pre-shared key (libp2p pnet) that every peer of the swarm holds. Each TCP connection is
//! encrypted with it below noise, so a peer without the key cannot complete a handshake, join the DHT, read
//! records or open streams. QUIC cannot carry pnet, so it is off in a private swarm.
//!
//! The file is the format IPFS and go-libp2p use (`/key/swarm/psk/1.0.0/`, `/base16/`, 64 hex digits).
use std::path::Path;

pub use libp2p::pnet::PreSharedKey;

use crate::NetError;

fn key_error(path: &Path, reason: impl std::fmt::Display) -> NetError {
    NetError::SwarmKey {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Writes a new random swarm key to `path` (mode 0600; never overwrites) and returns it.
pub fn generate_to_file(path: &Path) -> Result<PreSharedKey, NetError> {
    let key = PreSharedKey::new(rand::random());
    crate::identity::write_secret_file(path, key.to_string().as_bytes(), "a swarm key")
        .map_err(|reason| key_error(path, reason))?;
    tracing::info!(path = %path.display(), fingerprint = %key.fingerprint(), "generated new swarm key");
    Ok(key)
}

/// Reads a swarm key file.
pub fn load_from_file(path: &Path) -> Result<PreSharedKey, NetError> {
    let text = std::fs::read_to_string(path).map_err(|e| key_error(path, e))?;
    text.parse::<PreSharedKey>()
        .map_err(|e| key_error(path, format!("not a swarm key: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_to_overwrite() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("swarm.key");
        let key = generate_to_file(&path).expect("generate");
        let loaded = load_from_file(&path).expect("load");
        assert_eq!(
            key.fingerprint().to_string(),
            loaded.fingerprint().to_string()
        );
        assert!(generate_to_file(&path).is_err());
        std::fs::write(
            dir.path().join("bad.key"),
            "/key/swarm/psk/1.0.0/\n/base16/\nzz\n",
        )
        .expect("write");
        assert!(matches!(
            load_from_file(&dir.path().join("bad.key")),
            Err(NetError::SwarmKey { .. })
        ));
        assert!(load_from_file(&dir.path().join("missing.key")).is_err());
    }
}

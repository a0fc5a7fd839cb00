//! Identity key files: round trip, no overwrite, clear errors.

use petal_p2p::{generate_to_file, load_from_file, NetError};

#[test]
fn identity_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("keys").join("node.key");
    let peer = generate_to_file(&path).expect("generate");
    let keypair = load_from_file(&path).expect("load");
    assert_eq!(keypair.public().to_peer_id(), peer);

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "key file must be private");
    }
}

#[test]
fn identity_refuses_to_overwrite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("node.key");
    let peer = generate_to_file(&path).expect("generate");
    let err = generate_to_file(&path).expect_err("second generate must fail");
    assert!(matches!(err, NetError::Identity { .. }), "{err}");
    assert!(err.to_string().contains("already exists"), "{err}");
    // The original key is untouched.
    assert_eq!(
        load_from_file(&path).expect("load").public().to_peer_id(),
        peer
    );
}

#[test]
fn identity_missing_or_corrupt_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.key");
    let err = load_from_file(&missing).expect_err("missing");
    assert!(matches!(err, NetError::Identity { .. }));
    assert!(err.to_string().contains("no such file"), "{err}");

    let corrupt = dir.path().join("corrupt.key");
    std::fs::write(&corrupt, b"definitely not a protobuf keypair").expect("write");
    let err = load_from_file(&corrupt).expect_err("corrupt");
    assert!(err.to_string().contains("not a valid libp2p key"), "{err}");
}

//! Fuzz-style property tests: `decode_frame` sees bytes straight from untrusted peers, so on any input it must
//! return (never panic), and accept a frame only when the length prefix agrees with what it consumed.

use petal_proto::frame::{decode_frame, encode_frame, FrameError, PREFIX_LEN};
use petal_proto::pb;
use proptest::prelude::*;

/// Asserts the invariants of one `decode_frame` result on `buf`.
fn check(buf: &[u8], max: usize) {
    let announced = buf
        .first_chunk::<4>()
        .map(|p| u32::from_be_bytes(*p) as usize);
    match decode_frame::<pb::Request>(buf, max) {
        Ok((_, used)) => {
            let len = announced.expect("Ok without a full prefix");
            assert!(len <= max, "accepted {len} > max {max}");
            assert_eq!(used, PREFIX_LEN + len);
            assert!(used <= buf.len());
        }
        Err(FrameError::Truncated { expected, got }) => {
            assert_eq!(got, buf.len());
            assert!(expected > got);
            match announced {
                None => assert_eq!(expected, PREFIX_LEN),
                Some(len) => assert_eq!(expected, PREFIX_LEN + len),
            }
        }
        Err(FrameError::TooLarge { len, max: m }) => {
            assert_eq!(Some(len), announced);
            assert_eq!(m, max);
            assert!(len > max);
        }
        Err(FrameError::Decode(_)) => {
            let len = announced.expect("Decode without a full prefix");
            assert!(len <= max && PREFIX_LEN + len <= buf.len());
        }
        Err(FrameError::Io(e)) => panic!("pure decoder reported I/O: {e}"),
        Err(e @ FrameError::Timeout { .. }) => panic!("pure decoder has no clock: {e}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..256), max in 0usize..512) {
        check(&buf, max);
    }

    /// Arbitrary bodies behind a prefix that matches them: exercises the protobuf decoder far more than random
    /// prefixes, which are almost always Truncated or TooLarge.
    #[test]
    fn arbitrary_bodies_with_consistent_prefix(body in proptest::collection::vec(any::<u8>(), 0..256), extra in proptest::collection::vec(any::<u8>(), 0..8)) {
        let mut buf = (body.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(&body);
        buf.extend_from_slice(&extra);
        check(&buf, 1024);
    }

    /// Valid frames with one byte flipped: close to real traffic, so deep inside the decoder.
    #[test]
    fn mutated_valid_frames(session in any::<u64>(), position in any::<u32>(), n in 1usize..16, at in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let req = pb::Request { kind: Some(pb::request::Kind::Step(pb::Step {
            session_id: session,
            position,
            hidden: Some(petal_proto::tensor::from_f32(&vec![0.5; n], &[1, 1, n], pb::WireDType::F16)),
            ..Default::default()
        })) };
        let mut buf = encode_frame(&req).to_vec();
        check(&buf, 1024);
        let i = at.index(buf.len());
        buf[i] ^= xor;
        check(&buf, 1024);
    }
}

//! Convenience methods on the generated messages, kept out of the generated code so it stays untouched.

use crate::pb;

impl pb::Response {
    /// A response carrying an error: what a server answers whenever it cannot serve a request.
    pub fn error(code: pb::ErrorCode, msg: impl Into<String>) -> Self {
        Self {
            kind: Some(pb::response::Kind::Error(pb::Error {
                code: code as i32,
                message: msg.into(),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_response_carries_code_and_message() {
        let r = pb::Response::error(pb::ErrorCode::Busy, "too many sessions");
        match r.kind {
            Some(pb::response::Kind::Error(e)) => {
                assert_eq!(e.code(), pb::ErrorCode::Busy);
                assert_eq!(e.message, "too many sessions");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

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

impl pb::Request {
    /// A push whose sender wants no answer (`Push.unanswered`).
    pub fn is_unanswered_push(&self) -> bool {
        matches!(&self.kind, Some(pb::request::Kind::Push(p)) if p.unanswered)
    }
}

impl pb::ServerRecord {
    /// AutoNAT's verdict as announced: public, private or unknown (also for records that predate it).
    pub fn reachability_status(&self) -> &str {
        if self.reachability.is_empty() {
            "unknown"
        } else {
            &self.reachability
        }
    }

    /// The name of the dtype its hidden states travel in ("?" for one this build does not know).
    pub fn wire_dtype_name(&self) -> &'static str {
        pb::WireDType::try_from(self.dtype)
            .map(|d| d.name())
            .unwrap_or("?")
    }

    /// Its devices as `device[start..end]`, in block order.
    pub fn device_spans(&self) -> Vec<String> {
        self.devices
            .iter()
            .map(|d| format!("{}[{}..{}]", d.device, d.start_block, d.end_block))
            .collect()
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

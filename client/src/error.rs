//! Everything that can go wrong on the client side, typed.
use petal_model::BlockRange;
use petal_proto::pb;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Model(#[from] petal_model::ModelError),
    #[error(transparent)]
    Net(#[from] petal_p2p::NetError),
    #[error("no server covers blocks {}; model id {model_id}", fmt_ranges(.missing))]
    Uncovered {
        model_id: String,
        missing: Vec<BlockRange>,
    },
    #[error("server {peer} refused: {code:?}: {message}")]
    Server {
        peer: String,
        code: pb::ErrorCode,
        message: String,
    },
    #[error("server {peer}: {reason}")]
    Protocol { peer: String, reason: String },
    #[error("server {peer} did not answer within {seconds:.1} s")]
    Timeout { peer: String, seconds: f64 },
}

impl ClientError {
    /// Whether another server might succeed where this one failed: connection trouble, timeouts, and refusals that
    /// depend on the server's state. Bad requests and model mismatches would fail anywhere.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Net(_) | Self::Protocol { .. } | Self::Timeout { .. } => true,
            Self::Server { code, .. } => matches!(
                code,
                pb::ErrorCode::Internal
                    | pb::ErrorCode::ShuttingDown
                    | pb::ErrorCode::Busy
                    | pb::ErrorCode::CacheFull
                    | pb::ErrorCode::Unspecified
            ),
            Self::Model(_) | Self::Uncovered { .. } => false,
        }
    }
}

fn fmt_ranges(r: &[BlockRange]) -> String {
    r.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

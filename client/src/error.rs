//! Everything that can go wrong on the client side, typed.
use petal_model::BlockRange;
use petal_proto::pb;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The model files, tokenizer or local compute failed.
    #[error(transparent)]
    Model(#[from] petal_model::ModelError),
    /// The client's own peer could not start or reach the swarm.
    #[error(transparent)]
    Net(#[from] petal_p2p::NetError),
    /// The caller asked for something that cannot be done (an empty prompt, a context longer than the session);
    /// no server was at fault.
    #[error("bad request: {0}")]
    Request(String),
    /// No live server of this model covers these blocks.
    #[error("no server covers blocks {}; model id {model_id}", fmt_ranges(.missing))]
    Uncovered {
        model_id: String,
        missing: Vec<BlockRange>,
    },
    /// A server answered with an error.
    #[error("server {peer} refused: {code:?}: {message}")]
    Server {
        peer: String,
        code: pb::ErrorCode,
        message: String,
    },
    /// A server broke the protocol: a bad frame, an unexpected message, a closed stream, wrong hidden states.
    #[error("server {peer}: {reason}")]
    Protocol { peer: String, reason: String },
    /// A server did not answer in time.
    #[error("server {peer} did not answer within {seconds:.1} s")]
    Timeout { peer: String, seconds: f64 },
    /// The local blocks' scheduler failed outside the model (its thread could not start or is gone, or a batch
    /// panicked); the model's own refusals are [`ClientError::Model`].
    #[error(transparent)]
    LocalCompute(petal_model::SchedulerError),
}

impl From<petal_model::SchedulerError> for ClientError {
    fn from(e: petal_model::SchedulerError) -> Self {
        match e {
            petal_model::SchedulerError::Model(e) => Self::Model(e),
            other => Self::LocalCompute(other),
        }
    }
}

impl ClientError {
    /// Whether the connection, rather than the server's answer, failed: the stream broke or could not be
    /// opened, or the server's bytes made no sense. The same server may well succeed on a new connection.
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, Self::Net(_) | Self::Protocol { .. })
    }

    /// Whether the server took the session back to make room for another peer (fair sharing): nothing wrong with
    /// the server, so it is not banned; the session is opened again, there or elsewhere, and replayed.
    pub fn is_eviction(&self) -> bool {
        matches!(
            self,
            Self::Server {
                code: pb::ErrorCode::Evicted,
                ..
            }
        )
    }

    /// Whether a pushed step got no input from the previous server in time: nothing wrong with this server (its
    /// session is unchanged), the step is driven by the client instead.
    pub fn is_push_timeout(&self) -> bool {
        matches!(
            self,
            Self::Server {
                code: pb::ErrorCode::PushTimeout,
                ..
            }
        )
    }

    /// Whether another server might succeed where this one failed: anything a server said or did. Its error code
    /// cannot decide this (a hostile or broken server would answer "bad request" to everything and stop the
    /// client); what fails everywhere is cut short by the failover budget and by bans. Local errors are final.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Net(_) | Self::Protocol { .. } | Self::Timeout { .. } | Self::Server { .. } => {
                true
            }
            Self::Model(_) | Self::LocalCompute(_) | Self::Request(_) | Self::Uncovered { .. } => {
                false
            }
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

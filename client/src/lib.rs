//! petal-client: generate text through a Petal swarm.
//!
//! [`SwarmClient`] joins the swarm and finds servers in the DHT; [`router`] chains spans that cover the model;
//! [`InferenceSession`] streams hidden states through that chain; [`RemoteModel`] holds the local parts of the model
//! (embeddings, final norm, LM head) and generates with the same sampler as local generation. [`Generator`] runs
//! one generation loop over the local or the remote model, on a session a [`Conversation`] can keep across chat
//! turns.
pub mod conversation;
pub mod defaults;
pub mod error;
pub mod generator;
pub mod remote_model;
pub mod router;
pub mod session;
pub mod swarm;

pub use conversation::{Conversation, Turn};
pub use error::ClientError;
pub use generator::{Completion, Generator, GeneratorSession};
pub use remote_model::RemoteModel;
pub use router::{plan_range, plan_route, Hop};
pub use session::{Failover, InferenceSession, SessionConfig};
pub use swarm::SwarmClient;

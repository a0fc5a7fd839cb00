//! petal-client: generate text through a Petal swarm.
//!
//! [`SwarmClient`] joins the swarm and finds servers in the DHT; [`router`] chains spans that cover the model;
//! [`InferenceSession`] streams hidden states through that chain; [`RemoteModel`] holds the local parts of the model
//! (embeddings, final norm, LM head) and generates with the same sampler as local generation.
pub mod error;
pub mod remote_model;
pub mod router;
pub mod session;
pub mod swarm;

pub use error::ClientError;
pub use remote_model::RemoteModel;
pub use router::{plan_range, plan_route, Hop};
pub use session::{Failover, InferenceSession, SessionConfig};
pub use swarm::SwarmClient;

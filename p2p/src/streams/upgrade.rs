//! Negotiating the inference protocol on a new stream: no handshake of its own, the stream is handed over as is.
use std::convert::Infallible;
use std::future::{ready, Ready};

use libp2p::{
    core::{InboundUpgrade, OutboundUpgrade, UpgradeInfo},
    Stream, StreamProtocol,
};

/// Offers `protocols` (none while nobody accepts inbound streams, so peers learn it is unsupported).
pub struct Upgrade {
    pub protocols: Vec<StreamProtocol>,
}

impl UpgradeInfo for Upgrade {
    type Info = StreamProtocol;
    type InfoIter = std::vec::IntoIter<StreamProtocol>;

    fn protocol_info(&self) -> Self::InfoIter {
        self.protocols.clone().into_iter()
    }
}

impl InboundUpgrade<Stream> for Upgrade {
    type Output = Stream;
    type Error = Infallible;
    type Future = Ready<Result<Stream, Infallible>>;

    fn upgrade_inbound(self, stream: Stream, _: StreamProtocol) -> Self::Future {
        ready(Ok(stream))
    }
}

impl OutboundUpgrade<Stream> for Upgrade {
    type Output = Stream;
    type Error = Infallible;
    type Future = Ready<Result<Stream, Infallible>>;

    fn upgrade_outbound(self, stream: Stream, _: StreamProtocol) -> Self::Future {
        ready(Ok(stream))
    }
}

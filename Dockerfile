# The petal image: petal-node and petal on an empty base. Build it with scripts/docker-image, which compiles the
# release binaries on the host and collects them with their shared libraries and the dynamic loader into
# target/docker/rootfs; nothing is pulled (`scratch` is built into Docker) and no model is baked in (compose
# mounts them read-only at /models).
#
# There is no shell in the image: commands are given in exec form, e.g.
#   docker run --rm petal petal-node --help
FROM scratch
COPY target/docker/rootfs/ /
# NO_COLOR: plain log lines in `docker logs` (tracing colours them otherwise). RUST_LOG sets the level (default:
# info for petal-node, warn for petal).
ENV PATH=/usr/local/bin \
    NO_COLOR=1
# 31337: libp2p TCP and QUIC (UDP) as docker-compose.yml uses them; 9100: --metrics-listen; 8000: petal api.
EXPOSE 31337/tcp 31337/udp 9100/tcp 8000/tcp
CMD ["petal-node", "--help"]

# syntax=docker/dockerfile:1
#
# fencegate container image.
#
#   docker build -t fencegate .
#   docker run -d --name fencegate -p 8080:8080 \
#       -v fencegate-marks:/var/lib/fencegate \
#       -v "$PWD/my.toml:/etc/fencegate/fencegate.toml:ro" \
#       fencegate
#
# The marks (redb) live in the volume /var/lib/fencegate: keep it, or every scope forgets
# its high-water mark. The default config is config/edge.toml; mount your own over
# /etc/fencegate/fencegate.toml. Its admin listener is on loopback inside the container
# (the HEALTHCHECK below reaches it there); to publish 9090, set admin.listen to
# "0.0.0.0:9090" and an admin.token_file in your config.
# On `docker stop`, fencegate drains in-flight requests for up to server.shutdown_timeout
# (30s in the default config): give it that long, e.g. `docker stop -t 35`.

FROM rust:1-slim-bookworm AS builder
WORKDIR /build
# The whole source tree (minus what .dockerignore leaves out): Cargo.toml names bench and
# test targets, and cargo wants their files present even to build only the binary.
COPY . .
# Dependencies are cached across builds in the registry and target cache mounts, so a
# source change recompiles fencegate, not its dependencies. The binary is copied out of
# the cache mount, which is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/build/target \
    cargo build --release --locked --bin fencegate \
    && cp target/release/fencegate /usr/local/bin/fencegate

FROM debian:bookworm-slim
# curl is only for the HEALTHCHECK.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --user-group --uid 10001 --home-dir /var/lib/fencegate \
        --shell /usr/sbin/nologin fencegate \
    && mkdir -p /var/lib/fencegate /etc/fencegate \
    && chown fencegate:fencegate /var/lib/fencegate
COPY --from=builder /usr/local/bin/fencegate /usr/local/bin/fencegate
COPY config/edge.toml /etc/fencegate/fencegate.toml

USER fencegate
# mimalloc gives freed memory back to the system only when the thread that freed it
# allocates again; a worker that went quiet after a burst (clients that held HTTP/2
# streams and left) would keep it. Purging at once returns it (OPERATIONS, Limits).
ENV MIMALLOC_PURGE_DELAY=0
VOLUME /var/lib/fencegate
# 8080: the proxy. 9090: the admin API (loopback-only unless your config says otherwise).
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD curl -fsS http://127.0.0.1:9090/healthz || exit 1

ENTRYPOINT ["fencegate"]
CMD ["serve", "--config", "/etc/fencegate/fencegate.toml"]

# syntax=docker/dockerfile:1
# drumline: the binaries (the operators' `drumline`, the beat, the worker and its task supervisor) and the example configs in one
# small image.
#   docker build -t drumline .
#   docker compose up          (see docker-compose.yml: RabbitMQ, Redis, a beat, three workers)

# ---- build ----------------------------------------------------------------------------------
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep the registry and the target dir between builds (BuildKit); the binaries
# are copied out of the cached target dir because it is not part of the image layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --workspace --bins \
 && mkdir -p /out \
 && cp target/release/drumline target/release/drumline-beat target/release/drumline-worker target/release/drumline-supervisor /out/

# ---- run ------------------------------------------------------------------------------------
FROM debian:bookworm-slim
# ca-certificates: the system roots amqps:// and rediss:// URLs are checked against (mount your
# own CA and set [broker]/[redis] ca_file for a private CA); tzdata for task commands that format
# local times (drumline itself carries its own copy of the time zone database).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates tzdata \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --home-dir /app --shell /usr/sbin/nologin drumline
COPY --from=build /out/drumline /out/drumline-beat /out/drumline-worker /out/drumline-supervisor /usr/local/bin/
COPY examples/ /app/examples/
WORKDIR /app
USER drumline
# Point this at your own config (mount it, e.g. at /app/drumline.toml, and set DRUMLINE_CONFIG or
# pass --config). DRUMLINE_AMQP_URL and DRUMLINE_REDIS_URL override the URLs in the file.
ENV DRUMLINE_CONFIG=/app/examples/demo.toml
# Both binaries exit 0 on SIGTERM; a worker first lets its running tasks finish (shutdown_grace).
STOPSIGNAL SIGTERM
CMD ["drumline", "worker"]

# The kinference router image: `kinference` (serve) and `kinfctl` on a distroless base, run as
# a non-root user. The chart in charts/kinference runs it.
#
#   docker build -t REGISTRY/kinference:TAG .
#
# The build needs only crates.io; tests are not run here (CI runs them on the source tree).

FROM rust:1.95.0-bookworm AS build
WORKDIR /src
COPY . .
# rust-toolchain.toml pins 1.95.0, this base image's toolchain; rustup may still fetch the
# components it lists (rustfmt, clippy) on first use.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kinference -p kinfctl \
    && install -D -m 0755 target/release/kinference target/release/kinfctl -t /out/

# distroless/cc: glibc, libgcc, libstdc++ (libzmq, built from source by the `zmq` crate, is C++)
# and CA certificates, no shell; nonroot is uid/gid 65532, the
# user the chart's securityContext asks for.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
COPY LICENSE /usr/share/doc/kinference/LICENSE
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/kinference"]
CMD ["serve"]

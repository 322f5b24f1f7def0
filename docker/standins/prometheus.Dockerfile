# Stand-in for prom/prometheus, for `make compose-test` on a machine that
# reaches no image registry: Debian bookworm's prometheus (2.42), run like the
# official image: as `nobody`, the binary as entrypoint, data in /prometheus,
# and a `wget` for the healthcheck (busybox's there, GNU wget here).
ARG BASE=turbomq-test/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o nobody -g nogroup /prometheus /etc/prometheus
USER nobody
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]

# Stand-in for redis:7, for `make compose-test` on a machine that reaches no
# image registry: Debian bookworm's redis-server (7.0), run like the official
# image: the server runs as the user `redis` (uid 999), working in /data,
# which the entrypoint hands to that user.
ARG BASE=turbomq-test/debian:bookworm
FROM ${BASE}
RUN groupadd -r -g 999 redis && useradd -r -g redis -u 999 -d /data redis \
 && apt-get update \
 && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o redis -g redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]

#!/bin/sh
# As the official redis image's entrypoint: redis-server runs as `redis`.
set -e
if [ "$1" = "redis-server" ] && [ "$(id -u)" = "0" ]; then
  find . \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"

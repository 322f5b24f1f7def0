#!/bin/sh
# Runs the container's command. When one of its arguments is the demo model
# directory ($TURBOMQ_DEMO_MODEL: what docker-compose.yml passes as --model
# while MODEL is unset) and the model is not there yet, it is written first.
set -e
for arg in "$@"; do
  if [ "$arg" = "$TURBOMQ_DEMO_MODEL" ] && [ ! -f "$TURBOMQ_DEMO_MODEL/config.json" ]; then
    echo "writing the demo model to $TURBOMQ_DEMO_MODEL" >&2
    turbomq demo-model "$TURBOMQ_DEMO_MODEL" >/dev/null
  fi
done
exec "$@"

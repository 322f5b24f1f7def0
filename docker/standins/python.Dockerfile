# Stand-in for python:3.11-slim, for `make compose-test` on a machine that
# reaches no image registry (benchmarks/compose_test.py builds it only when
# the real image can be neither found nor pulled). Debian bookworm's Python
# 3.11 with its headers, pip and venv, set up like the official image (which
# has the headers too): `pip install` as root installs system-wide, `python`
# and `pip` are on PATH.
ARG BASE=turbomq-test/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-pip python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED \
 && ln -s /usr/bin/python3 /usr/local/bin/python
ENV LANG=C.UTF-8
CMD ["python3"]

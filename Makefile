# Two entry points: `make serve` and `make test`. Both set up what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_MODEL ?= .demo-model
STAMP := $(VENV)/.turbomq-installed

.PHONY: serve test chaos fuzz setup sysdeps native cuda-check clean FORCE

# Debian packages: libzmq (headers) for the broker's native data plane; a real
# redis-server, prometheus and docker-compose (to validate the compose file)
# for the service and the tests.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
sysdeps:
	@if ! command -v redis-server >/dev/null || ! command -v prometheus >/dev/null \
	    || ! command -v docker-compose >/dev/null || [ ! -e /usr/include/zmq.h ]; then \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q libzmq3-dev redis-server \
	    prometheus docker-compose; \
	fi

# torch goes in first and pinned: pip would otherwise pull a multi-GB CUDA build.
# The native build needs libzmq, hence sysdeps first.
$(STAMP): pyproject.toml native/CMakeLists.txt | sysdeps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q scikit-build-core pybind11 ninja
	$(PIP) install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

# The editable install maps each module file it saw when it ran: a module
# added, moved or removed needs a re-install (quick: the native build is
# incremental). $(MODULES) changes only when the list of modules does.
MODULES := $(VENV)/.turbomq-modules
$(MODULES): FORCE
	@mkdir -p $(VENV)
	@find broker clients worker monitoring -name '*.py' -not -path '*/__pycache__/*' | sort > $@.new
	@cmp -s $@.new $@ && rm -f $@.new || mv $@.new $@

$(VENV)/.turbomq-mapped: $(STAMP) $(MODULES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

setup: $(VENV)/.turbomq-mapped

# Rebuild the native module after C++ changes.
native: $(STAMP)
	$(PIP) install -q --no-build-isolation --no-deps -e .

$(DEMO_MODEL)/config.json: | setup
	$(VENV)/bin/turbomq demo-model $(DEMO_MODEL)

# The whole service on this machine: broker, 2 workers, a local redis-server.
# SERVE_ARGS=--smoke streams one generation through the client and exits.
serve: setup $(DEMO_MODEL)/config.json
	$(VENV)/bin/turbomq up --model $(DEMO_MODEL) --workers 2 $(SERVE_ARGS)

# Every CUDA source must compile for Hopper (sm_90a), GPU or not.
cuda-check:
	@set -e; for f in native/cuda/*.cu; do \
	  [ -e "$$f" ] || continue; \
	  echo "nvcc $$f"; \
	  nvcc -std=c++17 -arch=sm_90a -Inative/cuda -Inative/src -c "$$f" -o /dev/null; \
	done

test: setup sysdeps cuda-check
	# one intra-op thread per process: the suite runs several processes on 2 cores
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs -p no:cacheprovider

# The long chaos run (about 10 minutes): 1,000 sessions x 4 turns through a
# broker pair, CPU workers and Redis under random faults of every kind; writes
# docs/benchmarks/chaos.md. CHAOS_ARGS=--sessions 100 --minutes 1 for a short one.
chaos: setup sysdeps
	OMP_NUM_THREADS=1 $(PY) benchmarks/chaos.py $(CHAOS_ARGS)

# The long fuzz run: 1,000,000 malformed frames at a broker (both sockets)
# with a CPU worker behind it; writes docs/benchmarks/fuzz.md.
fuzz: setup sysdeps
	OMP_NUM_THREADS=1 $(PY) benchmarks/fuzz.py $(FUZZ_ARGS)

# `docker compose up`, built and run for real (not part of `make test`: it
# needs a Docker engine, or root to start one, and several minutes): builds
# the images (stand-in base images where no registry answers), starts the
# stack, sends requests through it with the client, checks every Prometheus
# target, then `down -v`; writes docs/benchmarks/compose.md (docs/operations.md).
# COMPOSE_TEST_ARGS=--no-cache builds from scratch.
.PHONY: compose-test
compose-test: setup sysdeps
	$(PY) benchmarks/compose_test.py $(COMPOSE_TEST_ARGS)

clean:
	rm -rf build $(VENV) $(DEMO_MODEL)

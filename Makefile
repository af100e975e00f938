# gear: `make demo` and `make test` set up everything they need (.venv/).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NVCC ?= $(shell command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CU_SOURCES := $(wildcard gear_kernels/*.cu)
CUBINS := $(patsubst gear_kernels/%.cu,.build/cubin/%.cubin,$(CU_SOURCES))
# Source-tree imports for machines without the venv (the GPU machine).
# GPU_SITE: a folder of pure-Python dependencies the GPU machine lacks (it reaches no
# registry): `make gpu-wheels` here, carry .whl, and there
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` then GPU_SITE=/tmp/site.
GPU_SITE ?= /tmp/site
GPU_ENV := PYTHONPATH=$(CURDIR):$(GPU_SITE) PYTHONUNBUFFERED=1

.PHONY: gpu-wheels bench-connect bench-streams install test test-frameworks test-tf test-nixl bench-nixl test-gpu demo bench bench-gpu bench-planes bench-planes-gpu bench-shards bench-shards-gpu bench-reverb bench-wire serve proto proto-check lint kernels-build clean install-service bench-scale bench-scale-gpu bench-ranks bench-tier-gpu bench-remote test-tf-published

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Compile every CUDA source for sm_90 so a kernel that does not build fails here; where the CUDA
# toolkit is missing (no GPU is needed for `make test`) the check is skipped, and says so.
ifeq ($(strip $(NVCC)),)
kernels-build:
	@echo "kernels-build: skipped: nvcc not found (the CUDA toolkit checks $(CU_SOURCES) where it is installed)"
else
kernels-build: $(CUBINS)
endif

.build/cubin/%.cubin: gear_kernels/%.cu $(wildcard gear_kernels/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) -arch=sm_90 --cubin -Igear_kernels -o $@ $<

proto: install
	$(VPY) tools/gen_protos.py

proto-check: install
	$(VPY) tools/gen_protos.py --check

lint: install
	$(VPY) -m ruff check .

test: install kernels-build proto-check lint
	$(VPY) -m pytest -q -m "not gpu and not rdma"

# Datasets in PyTorch and JAX loops (tests marked torch / jax) in their own venv: torch's CPU build
# (about 190 MB where a +cpu wheel is at hand, else PyPI's torch) and jax; `make test` skips them.
FRAMEWORKS_VENV := .venv-frameworks
$(FRAMEWORKS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FRAMEWORKS_VENV)/bin/python -m pip install -q -e '.[dev]'
	$(FRAMEWORKS_VENV)/bin/python -m pip install -q 'torch==2.13.0+cpu' || $(FRAMEWORKS_VENV)/bin/python -m pip install -q torch
	$(FRAMEWORKS_VENV)/bin/python -m pip install -q jax
	touch $@

test-frameworks: $(FRAMEWORKS_VENV)/.installed
	$(FRAMEWORKS_VENV)/bin/python -m pytest -q -m "torch or jax" tests

# On the GPU machine: system python3 with cupy, run from the source tree.
# Wheels of the daemon's pure-Python dependencies that the GPU machine does not have.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
	  "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "uvloop==0.23.0"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "py-spy==0.4.3"  # prof/

	# NIXL for the nixl plane (CUDA 13 build): its nixl_ep_cu13 folder (expert-parallel kernels gear does not
	# use) dropped so that .whl fits the device machine's carry limit; there the same --target install.
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl/nixl-full \
	  --platform manylinux_2_28_x86_64 "nixl-cu13==1.5.1"
	$(PYTHON) tools/repack_wheel.py --drop nixl_ep_cu13 --out .whl .whl/nixl-full/nixl_cu13-*.whl
	rm -rf .whl/nixl-full

test-gpu:
	$(GPU_ENV) $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests

bench-gpu:
	$(GPU_ENV) $(PYTHON) bench/bench_gpu.py

# The device tier (a table mirrored in GPU memory, read through CUDA IPC): same GPU, peer GPU, insert cost, churn.
bench-tier-gpu:
	$(GPU_ENV) $(PYTHON) bench/bench_tier.py

# Learner data planes end to end; on the GPU machine with shm into GPU memory.
bench-planes-gpu:
	$(GPU_ENV) $(PYTHON) bench/bench_planes.py --no-reverb

# One table over 1, 2 and 4 daemons on this host (small sizes; docs/SHARDING.md).
bench-shards: install
	$(VPY) bench/bench_shards.py

# The same on the GPU machine: B=256 into GPU memory, selection over 4 shards of 1M items.
bench-shards-gpu:
	$(GPU_ENV) $(PYTHON) bench/bench_shards.py --full --device cuda

# Many actor processes inserting (same-host insert plane, network path through the ingest workers), and a
# learner beside them. Small (--quick) on machines of fewer than 8 CPUs, in full otherwise.
SCALE_ARGS ?= $(if $(shell test $$(nproc) -lt 8 && echo small),--quick,)
bench-scale: install
	$(VPY) bench/bench_scale.py $(SCALE_ARGS)

# On the GPU machine (system python3 with cupy, no venv): the learner gathers into GPU memory.
bench-scale-gpu:
	$(GPU_ENV) $(PYTHON) bench/bench_scale.py $(SCALE_ARGS)

demo: install
	$(VPY) examples/demo.py

# A decision transformer trained with DDP on replay (examples/train_dt_ddp.py): CPU ranks over gloo in
# .venv-frameworks (torch's CPU build); on a GPU machine one rank per GPU over NCCL, from the source tree.
DDP_ARGS ?=
.PHONY: example-ddp example-ddp-gpu
example-ddp: $(FRAMEWORKS_VENV)/.installed
	$(FRAMEWORKS_VENV)/bin/python examples/train_dt_ddp.py $(DDP_ARGS)

example-ddp-gpu:
	NCCL_NVLS_ENABLE=0 $(GPU_ENV) $(PYTHON) examples/train_dt_ddp.py --device cuda $(DDP_ARGS)

bench: install
	$(VPY) bench/bench_core.py

# Hand-framed protobuf pieces (gear_contract/wire.py) against protobuf's own encoder and parser.
bench-wire: install
	$(VPY) bench/bench_wire.py

# Data planes on this machine (Reverb side by side when .venv-reverb exists).
bench-planes: install
	$(VPY) bench/bench_planes.py

# DeepMind Reverb 0.14.0 (needs Python 3.11 and TensorFlow) in its own venv, then
# the core benchmark against both, side by side.
REVERB_VENV := .venv-reverb
$(REVERB_VENV)/.installed:
	python3.11 -m venv $(REVERB_VENV)
	$(REVERB_VENV)/bin/python -m pip install -q --upgrade pip
	$(REVERB_VENV)/bin/python -m pip install -q "dm-reverb[tensorflow]==0.14.0"
	touch $@

bench-reverb: install $(REVERB_VENV)/.installed
	$(VPY) bench/reverb/compare.py --reverb-python $(REVERB_VENV)/bin/python

# Connect storms: 100, 300 and 1,000 actors (a Client and a trajectory_writer each), gear and Reverb side by
# side (Reverb from .venv-reverb: `make bench-reverb` builds it; without it, gear's figures only).
bench-connect: install
	$(VPY) bench/bench_connect.py --reverb-python $(REVERB_VENV)/bin/python

# The control plane: 1,000 open writer streams on one daemon, RSS per stream, mutate and Select
# latency (Reverb's mutate side by side when .venv-reverb exists).
# Remote learners and actors over TCP streams against the TCP ceiling of the same link (a veth pair into a
# network namespace when run as root, and loopback); the lead adds DEVICE=cuda on the GPU machine.
bench-remote: install
	$(VPY) bench/bench_remote.py $(if $(DEVICE),--device $(DEVICE))

bench-streams: install
	$(VPY) bench/bench_streams.py

# TensorFlow learners (gear_client.tf.datasets, tf_client; TF-Agents' replay buffer through the reverb
# alias) in their own venv with tensorflow-cpu (about 1.6 GB, so not part of `make test`, whose runs
# skip the `tf` tests); the README's TensorFlow block too.
TF_VENV := .venv-tf
$(TF_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install -q --upgrade pip
	$(TF_VENV)/bin/python -m pip install -q -e '.[dev,tf]'
	# TF-Agents itself (tests/client/tf/test_tf_agents.py). --no-deps: it pins typing-extensions==4.5
	# (grpcio needs >= 4.12) and tf-keras would pull a second TensorFlow; what it imports is listed.
	$(TF_VENV)/bin/python -m pip install -q --no-deps tf-agents==0.19.0 tf-keras==2.21.0
	$(TF_VENV)/bin/python -m pip install -q gin-config "gym==0.23.0" "tensorflow-probability==0.23.0" cloudpickle \
		pillow wrapt dm-tree decorator gast
	touch $@

test-tf: $(TF_VENV)/.installed
	$(TF_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/client/tf tests/test_readme.py

# gear_ray on a simulated Ray cluster (tests/deploy/test_ray.py: two raylets on this machine, about a minute),
# in its own venv with the ray extra (a few hundred MB, so not part of `make test`, whose runs skip the `ray` tests).
RAY_VENV := .venv-ray
.PHONY: test-ray
$(RAY_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install -q --upgrade pip
	$(RAY_VENV)/bin/python -m pip install -q -e '.[dev,ray]'
	touch $@

test-ray: $(RAY_VENV)/.installed
	$(RAY_VENV)/bin/python -m pytest -q -p no:cacheprovider -m ray tests/deploy

# The nixl plane (tests marked nixl; `make test` skips them, saying why) in its own venv: NIXL's wheel without
# torch (nixl-cu12 declares it but never imports it unless handed torch tensors; numpy is what it needs).
# Over UCX's TCP transport: loopback and a veth pair into a network namespace (root).
NIXL_VENV := .venv-nixl
$(NIXL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(NIXL_VENV)
	$(NIXL_VENV)/bin/python -m pip install -q --upgrade pip
	$(NIXL_VENV)/bin/python -m pip install -q -e '.[dev]'
	$(NIXL_VENV)/bin/python -m pip install -q --no-deps "nixl-cu12==1.5.1"
	$(NIXL_VENV)/bin/python -c "from gear_contract import nixl_agents as n; r = n.unavailable_reason(); \
	  assert r is None, r"
	touch $@

test-nixl: $(NIXL_VENV)/.installed
	$(NIXL_VENV)/bin/python -m pytest -q -p no:cacheprovider -m nixl tests/data_planes

# The nixl plane's learner against the TCP ceiling of the same link (veth pair and loopback).
bench-nixl: $(NIXL_VENV)/.installed
	$(NIXL_VENV)/bin/python bench/bench_nixl.py

# Reverb's and TF-Agents' own published tests, unchanged, against gear through the reverb alias
# (tests/client/tf/published_tests.py: eager off where a file's __main__ turns it off; the tests that
# check what docs/REVERB_COMPAT.md lists as different are skipped by name, with the reason). TF-Agents'
# come in its wheel (installed in .venv-tf). dm-reverb publishes wheels without tests and no sdist, so
# Reverb's run only from a checkout of github.com/google-deepmind/reverb: REVERB_SRC=/path/to/reverb.
# Each file runs in its own pytest process (graph-mode and eager files cannot share one).
PUBLISHED := .build/published-tests
TFA_TESTS := replay_buffers/reverb_replay_buffer_test.py replay_buffers/reverb_utils_test.py
REVERB_TESTS := trajectory_dataset_test.py timestep_dataset_test.py trajectory_dataset_eager_test.py \
	timestep_dataset_eager_test.py pattern_dataset_test.py structured_writer_test.py
REVERB_SRC ?=
test-tf-published: $(TF_VENV)/.installed
	rm -rf $(PUBLISHED) && mkdir -p $(PUBLISHED)/tf_agents $(PUBLISHED)/reverb
	site=$$($(TF_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
		for f in $(TFA_TESTS); do cp "$$site/tf_agents/$$f" $(PUBLISHED)/tf_agents/; done
	@if [ -n "$(REVERB_SRC)" ]; then for f in $(REVERB_TESTS); do cp "$(REVERB_SRC)/reverb/$$f" $(PUBLISHED)/reverb/; done; \
		else echo "REVERB_SRC not set: Reverb's own tests are not run (dm-reverb ships none on PyPI)"; fi
	status=0; for f in $(PUBLISHED)/*/*_test.py; do \
		PYTHONPATH=tests/client/tf $(TF_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider -p published_tests \
			--rootdir=$(CURDIR) -c pyproject.toml --timeout 120 -o timeout_method=thread "$$f" || status=1; \
	done; exit $$status

serve: install
	$(VENV)/bin/gear-server --config deploy/gear-server.example.toml

# The systemd service on this machine (run as root): user, virtualenv, /etc/gear, unit.
# Options go through INSTALL_SERVICE_ARGS, e.g. "--start --generate-token" (docs/OPERATIONS.md).
install-service:
	deploy/install-service.sh $(INSTALL_SERVICE_ARGS)

clean:
	rm -rf .build $(VENV) .pytest_cache

# Data-parallel ranks on one global selection against independent samplers, and column projection's bytes
# (host memory here; on the GPU machine: make bench-ranks RANKS_ARGS="--device cuda --world 4").
RANKS_ARGS ?=
bench-ranks: install
	$(VPY) bench/bench_ranks.py $(RANKS_ARGS)

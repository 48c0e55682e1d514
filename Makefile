# make demo  - install into .venv if needed, then train the tiny GPT on 4 CPU ranks (TP2 x PP2)
# make test  - install into .venv if needed, then run the test suite (what CI runs)
# make test-fast  - the inner loop: every test but the multi-rank and Slurm ones (~2 min on 2 cores)
# make gpu-check [ARGS=--record]  - the prepared GPU check (tools/gpu_check.py); skips without CUDA
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NPROC  ?= 4
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast bench clean-demo gpu-check

setup: $(STAMP)

# A list of setup.py, one requirement a line (read, not run: the Dockerfile reads it the same way).
SETUP_LIST = $(PY) -c "import ast, sys; t = ast.parse(open('setup.py').read()); print('\n'.join(next( \
	ast.literal_eval(n.value) for n in t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == sys.argv[1])))"

# Re-installs only when setup.py changes; torch==2.13.0 is pinned so pip takes the CPU wheel
# where one is provided locally instead of pulling a CUDA build. NO_DEPS_REQUIRES (mup) go in without
# their own requirements, and a torchvision an older .venv got from them is removed: setup.py says why.
$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $$($(SETUP_LIST) NO_DEPS_REQUIRES)
	@if $(PY) -m pip show --quiet torchvision 2>/dev/null; then \
		echo "removing torchvision (no build of it matches the CPU torch; see setup.py)"; \
		$(PY) -m pip uninstall --quiet --yes torchvision; fi
	@touch $(STAMP)

# pretrain_gpt.py --nproc-per-node checks the configuration for NPROC ranks, then starts them.
demo: setup
	PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 $(PY) pretrain_gpt.py --nproc-per-node $(NPROC) \
		--config configs/demo.yaml $(ARGS)

test: setup
	# One intra-op thread per process: tests launch several ranks on few cores.
	PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# Single-process tests only: the multi-rank ones (torchrun / mp.spawn launches, marked `multirank`)
# are where the suite's time goes; `make test` runs them.
test-fast: setup
	PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not multirank and not slurm" $(PYTEST_ARGS)

bench: setup
	$(PY) tools/bench_parallel.py

# No `setup` prerequisite: inside the Docker image (or any CUDA environment) the system Python
# already holds the CUDA build of torch, which a fresh venv would not see. The venv is used when
# there is one.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONWARNINGS=ignore $(GPU_PY) tools/gpu_check.py $(ARGS)

clean-demo:
	rm -rf runs/demo

# make demo  - install into .venv if needed, then train the tiny GPT on 4 CPU ranks (TP2 x PP2)
# make test  - install into .venv if needed, then run the test suite (what CI runs)
# make test-fast  - the inner loop: every test but the multi-rank and Slurm ones (~2 min on 2 cores)
# make gpu-check [ARGS=--record]  - the prepared GPU check (tools/gpu_check.py); skips without CUDA
# make figures-status  - which kept figures in docs/figures are stale, and the docs quoting them
# make figures-marks  - write the stale marks next to the docs' quotes of stale figures
# make figures [ARGS=--dry-run]  - rerun the stale benches one after another from clean clones of HEAD (an hour+)
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NPROC  ?= 4
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast bench clean-demo gpu-check figures-status figures-marks figures

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
	@$(BYTECODE)
	PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 $(PY) pretrain_gpt.py --nproc-per-node $(NPROC) \
		--config configs/demo.yaml $(ARGS)

# One intra-op thread per process: tests launch several ranks on few cores.
TEST_ENV := PYTHONWARNINGS=ignore OMP_NUM_THREADS=1
# The project's own bytecode, compiled once: where PYTHONDONTWRITEBYTECODE is set (as on CI's
# machines) every rank process would otherwise compile megatron_ext anew (~0.4 s of CPU each;
# the suite starts a few hundred). Python ignores a .pyc whose source changed.
BYTECODE := $(PY) -m compileall -q -j 0 megatron_ext deepspeed_patches tools pretrain_gpt.py > /dev/null
FAST     := -m "not multirank and not slurm"
XDIST    ?= 2
# worksteal: an idle worker takes queued tests from the other (the single-process tests run 0-12 s
# each); first pass, arms interleaved load/worksteal in rotated order: 93, 110, 94, 99 s against
# 84, 90, 90, 87 s.
DIST     := --dist worksteal

# Two passes, both always run: the single-process tests on $(XDIST) pytest-xdist workers, then the
# multi-rank and Slurm tests one at a time (each launches several ranks, which already fill the
# cores, and their heartbeat and fail-slow checks want the machine to themselves). Exit 5 (nothing
# selected in a pass, e.g. PYTEST_ARGS=tests/ft) counts as passed. When the first pass fails, its
# failures are named again at the very end, where a log cut to its tail still shows them.
test: setup
	@$(BYTECODE)
	@rc=0; log=$$(mktemp -t megatron-ext-pass1.XXXXXX); \
	{ $(TEST_ENV) $(PY) -m pytest -q -n $(XDIST) $(DIST) $(FAST) $(PYTEST_ARGS); echo $$? > $$log.rc; } 2>&1 | tee $$log; \
	r1=$$(cat $$log.rc); [ "$$r1" = 0 ] || [ "$$r1" = 5 ] || rc=1; \
	$(TEST_ENV) $(PY) -m pytest -q -m "multirank or slurm" $(PYTEST_ARGS) || [ $$? = 5 ] || rc=1; \
	if [ "$$r1" != 0 ] && [ "$$r1" != 5 ]; then echo "== the first pass (single-process tests) failed, exit $$r1:"; \
		grep -E '^(FAILED|ERROR) ' $$log || tail -n 30 $$log; fi; \
	rm -f $$log $$log.rc; exit $$rc

# The inner loop: the first pass of `make test` alone (the multi-rank launches, marked `multirank`,
# are where the suite's time goes).
test-fast: setup
	@$(BYTECODE)
	$(TEST_ENV) $(PY) -m pytest -q -n $(XDIST) $(DIST) $(FAST) $(PYTEST_ARGS)

bench: setup
	$(PY) tools/bench_parallel.py

# docs/benchmarks.md, "Figures kept in docs/figures". A stale figure is one measured before a
# later commit changed a file its bench loads; a doc quoting one carries a generated mark, which
# figures-marks adds, updates and removes (the figures test fails where one is missing or untrue).
# `figures` measures the stale ones again, each bench with the command its figure recorded, one
# after another (they share the cores), then moves the old runs under superseded/ and rewrites the
# marks; the benches' ranks take one intra-op thread each, as in the tests.
figures-status: setup
	@$(PY) tools/figures.py status

figures-marks: setup
	@$(PY) tools/figures.py marks

figures: setup
	$(TEST_ENV) $(PY) tools/figures.py rerun $(ARGS)

# No `setup` prerequisite: inside the Docker image (or any CUDA environment) the system Python
# already holds the CUDA build of torch, which a fresh venv would not see. The first of the venv
# and python3 whose torch is a CUDA build; else the venv if there is one (without CUDA the check
# skips, or fails if an NVIDIA device is present); else python3. GPU_PY=... picks another.
# Evaluated only here (`=`): other targets do not import torch to decide. The outer timeout is a
# last resort past the script's own --hard-limit-s (540 s), which still prints the report.
GPU_PY = $(shell for p in $(PY) python3; do $$p -c "import sys, torch; sys.exit(torch.version.cuda is None)" \
	2>/dev/null && echo $$p && exit; done; test -x $(PY) && echo $(PY) || echo python3)
GPU_TIMEOUT ?= 590
gpu-check:
	PYTHONWARNINGS=ignore timeout -k 10 $(GPU_TIMEOUT) $(GPU_PY) tools/gpu_check.py $(ARGS)

clean-demo:
	rm -rf runs/demo

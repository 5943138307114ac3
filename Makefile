# The two commands a newcomer needs (see README.md):
#   make run   - create .venv if missing, install, run the main job on the bundled digits data (experiments.tour)
#   make test  - create .venv if missing, install, run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run run-fmnist test data bench bench-train bench-recovery bench-state-sharding gossip-consensus docs serve-docs typecheck

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m experiments.tour $(ARGS)

# The main job's contrast on the real Fashion-MNIST files (make data first installs them); the per-worker
# gradient loop, as the committed docs/results/tour_fmnist.json was made (batched, the 784-input MLP differs
# from it by float32 ulps).
run-fmnist: data
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m experiments.tour data=fashion_mnist trainer.batched_gradients=false $(ARGS)

# Real Fashion-MNIST (Xiao, Rasul, Vollgraf 2017): Debian's dataset-fashion-mnist package puts the
# four published IDX files in /usr/share/datasets/fashion-mnist, where data=fashion_mnist finds them
# without data.root. Without apt-get, experiments.data_files says which files to place where (or
# data.download=true where a network exists). Either way the decompressed files are verified.
FMNIST_DIR := /usr/share/datasets/fashion-mnist
data: $(STAMP)
	@if [ ! -f $(FMNIST_DIR)/t10k-labels-idx1-ubyte.gz ] && command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "make data: installing Debian's dataset-fashion-mnist (30 MB)"; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	fi
	$(PY) -m experiments.data_files fashion_mnist

# The site is built once, with --strict, by tests/test_docs_build.py::test_mkdocs_build_strict
# (which also checks the pages it renders): building it again here took as long (13 to 45 s).
# Two pytest workers (pytest-xdist), one test file each at a time (module fixtures are built once):
# 8.5 min instead of 13.4 on the quiet 2-core machine. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	WANDB_MODE=disabled $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile robustagg attacks experiments tests docs README.md
	$(PY) -m mypy robustagg attacks

bench: $(STAMP)
	$(PY) -m experiments.bench $(ARGS)

bench-train: $(STAMP)
	WANDB_MODE=disabled $(PY) -m experiments.bench_train $(ARGS)

bench-recovery: $(STAMP)
	WANDB_MODE=disabled $(PY) -m experiments.bench_recovery $(ARGS)

bench-state-sharding: $(STAMP)
	WANDB_MODE=disabled $(PY) -m experiments.bench_state_sharding $(ARGS)

gossip-consensus: $(STAMP)
	$(PY) -m experiments.gossip_consensus $(ARGS)

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

serve-docs: $(STAMP)
	$(PY) -m mkdocs serve

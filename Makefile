# make demo  - set up, then run the main job
# make test  - set up, then run every test
# make test-fast - the tier for every edit: every test not marked `slow` or `timing`
# make coverage  - every test under coverage.py, then line coverage of tf_topk/
# Set-up is idempotent: .venv is created if missing, requirements installed
# once (again when requirements.txt changes), the op library rebuilt when a
# source under cc/ changes.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.requirements-installed
LIBRARY := tf_topk/_tf_topk_ops.so
CC_SOURCES := $(shell find cc -name '*.cc' -o -name '*.h' -o -name '*.cuh' -o -name '*.py')
PYTEST_ARGS ?=

.PHONY: setup build test test-fast coverage demo bench gpu-check clean

# Each set-up step says what it does; on a fresh 2-core machine the whole set-up takes about 9 minutes.
$(PY):
	@echo "set-up: a virtual environment in $(VENV) (seconds)"
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): requirements.txt requirements-no-deps.txt | $(PY)
	@echo "set-up: TensorFlow 2.21 and the requirements, then tf_topk itself with its op library (compiled with"
	@echo "        g++ and nvcc): the longest step, most of the set-up's 9 minutes on a fresh machine"
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-no-deps.txt
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

$(LIBRARY): $(CC_SOURCES) | $(INSTALLED)
	@echo "set-up: the op library tf_topk/_tf_topk_ops.so, rebuilt for a changed source under cc/ (minutes)"
	$(PY) cc/build_ops.py

setup: $(INSTALLED) $(LIBRARY)

build: setup

# Three pytest processes (each test file whole in one; on 2 cores three beat two and four, docs/testing.md),
# then the `timing` tests alone (tests/conftest.py); exit status 5 is "no test selected", where
# PYTEST_ARGS selects none of one part. `make test` and `make coverage` run the same two parts
# (pytest's arguments after `-m pytest`).
PARALLEL := -n 3 --dist loadfile
UNTIMED_PART := -q $(PARALLEL) -m "not timing" $(PYTEST_ARGS) || [ $$? -eq 5 ]
TIMING_PART := -q -m timing $(PYTEST_ARGS) || [ $$? -eq 5 ]

test: setup
	$(PY) -m pytest $(UNTIMED_PART)
	$(PY) -m pytest $(TIMING_PART)

test-fast: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not slow and not timing" $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Worker processes measure themselves too, forked ones included (pyproject.toml's [tool.coverage.run];
# its `patch = fork` needs coverage 7.10.4).
coverage: setup
	$(PY) -m pip install --quiet "coverage>=7.10.4"
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -m pytest $(UNTIMED_PART)
	$(PY) -m coverage run -m pytest $(TIMING_PART)
	$(PY) -m coverage combine --quiet
	$(PY) -m coverage report --skip-empty

demo: setup
	$(PY) examples/demo.py --workers 2 --density 0.01 --epochs 10

bench: setup
	$(PY) -m tf_topk.bench select --n 25000000 --density 0.001 --json
	$(PY) -m tf_topk.bench select --n 25000000 --density 0.001 --dist student_t --json

# Compiles the standalone CUDA harness (no GPU needed); on a GPU machine
# `python benchmarks/gpu_check.py` also checks and times it.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --compile-only

clean:
	rm -rf build *.egg-info $(LIBRARY) tf_topk/_tf_topk_ops.json benchmarks/gpu/*.so

# The Bazel build of the same op library: make bazel-test (see bazel/README.md).
include bazel/bazel.mk

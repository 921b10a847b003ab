# The Bazel build of the op library (see bazel/README.md). Included from the
# main Makefile, which defines PY (the venv's python) and `setup`.
#
# make bazel-test       set up, build //:tf_topk_ops with Bazel, check that it is
#                       the same op as the setup.py library, then run
#                       tests/test_ops.py against it (TF_TOPK_LIBRARY)
# make bazel-build      set up, install Bazel if missing, configure, build
# make bazel-configure  write .tf_configure.bazelrc from the venv's TensorFlow
# make bazel-clean      remove Bazel's outputs and its output root
#
# BAZEL_CONFIGURE_FLAGS=--no-cuda builds the CPU kernels only (TF_TOPK_CUDA=0|1
# works too, as for cc/build_ops.py). Bazel's output root lives in the clone
# (.bazel-cache, gitignored and .bazelignored), so removing the clone removes it.

BAZEL ?= bazel
BAZEL_OUTPUT_USER_ROOT ?= $(CURDIR)/.bazel-cache
# The server exits after 10 idle minutes (Bazel's default is 3 hours).
BAZEL_STARTUP_FLAGS ?= --output_user_root=$(BAZEL_OUTPUT_USER_ROOT) --max_idle_secs=600
BAZEL_BUILD_FLAGS ?= --jobs=2
BAZEL_CONFIGURE_FLAGS ?=
BAZEL_LIBRARY := bazel-bin/_tf_topk_ops.so
BAZEL_REFERENCE_LIBRARY ?= tf_topk/_tf_topk_ops.so
BAZEL_RUN = $(BAZEL) $(BAZEL_STARTUP_FLAGS)

.PHONY: bazel-install bazel-configure bazel-build bazel-test bazel-clean

# Debian's bazel-bootstrap (Bazel 4.2) when no `bazel` is on PATH.
bazel-install:
	@if command -v $(BAZEL) >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "bazel-install: '$(BAZEL)' is not on PATH and this system has no apt-get. Install Bazel 4.2 or" >&2; \
	  echo "newer (WORKSPACE mode), or pass BAZEL=/path/to/bazel, then re-run." >&2; exit 1; \
	fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else \
	  echo "bazel-install: '$(BAZEL)' is not on PATH, and installing it needs root. Run" >&2; \
	  echo "    sudo apt-get install -y bazel-bootstrap" >&2; \
	  echo "(Debian/Ubuntu's Bazel 4.2), or pass BAZEL=/path/to/bazel, then re-run make." >&2; exit 1; \
	fi; \
	echo "[bazel] installing Debian's bazel-bootstrap (Bazel 4.2) with apt-get"; \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap || \
	  { $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap; }

bazel-configure: setup
	$(PY) bazel/configure.py $(BAZEL_CONFIGURE_FLAGS)

bazel-build: bazel-configure bazel-install
	$(BAZEL_RUN) build $(BAZEL_BUILD_FLAGS) //:tf_topk_ops

bazel-test: bazel-build
	$(PY) bazel/check_library.py $(BAZEL_LIBRARY) --reference $(BAZEL_REFERENCE_LIBRARY)
	TF_TOPK_LIBRARY=$(CURDIR)/$(BAZEL_LIBRARY) $(PY) -m pytest -q $(PYTEST_ARGS) tests/test_ops.py

bazel-clean:
	-if command -v $(BAZEL) >/dev/null 2>&1 && [ -d $(BAZEL_OUTPUT_USER_ROOT) ]; then \
	  $(BAZEL_RUN) clean --expunge; $(BAZEL_RUN) shutdown; fi
	chmod -R u+w $(BAZEL_OUTPUT_USER_ROOT) 2>/dev/null; rm -rf $(BAZEL_OUTPUT_USER_ROOT) bazel-bin bazel-out bazel-testlogs bazel-$(notdir $(CURDIR)) .tf_configure.bazelrc

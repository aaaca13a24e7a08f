# mxflux developer entry points. Everything is installed into .venv by `make setup`;
# nothing needs to be installed by hand.
#
#   make run    set up the runtime, then run the default job (`mxflux train`: tiny MXFP6 Flux on the demo dataset)
#   make test   set up the runtime and the test extras, then run the test suite (CI; the slow tests skipped)
#   make test-slow  only the slow compiled and distributed end-to-end tests
#   make test-kernels  the Triton kernels' tests on a CPU: tests/gpu under Triton's interpreter, then
#               their ahead-of-time sm_90 compiles (not part of `make test`: ~15 min on 2 cores)
#   make test-cute  the CuTe-DSL GEMMs' CPU tests: its epilogue's layouts, its and quack's sm_90a builds (not part of
#               `make test`: nvidia-cutlass-dsl is a ~100 MB download; ~1 min)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# One stamp per install step: the runtime (what `make run` needs) and the test extras on top of it
# (pytest, and diffusers / transformers for the equivalence and `data prepare` tests), so that
# `make run` never installs what only the tests use, and `make test` after `make run` still does.
RUNTIME := $(VENV)/.installed-runtime
TESTING := $(VENV)/.installed-test
# Pinned and installed first on its own: pip then sees torch>=2.11 as satisfied and does not
# replace it with a multi-GB CUDA build when it resolves the package's dependencies.
TORCH  := torch==2.13.0

.PHONY: setup setup-test run test test-slow test-kernels test-cute clean

setup: $(RUNTIME)

setup-test: $(TESTING)

$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e .
	touch $@

# Redone whenever the runtime is (a changed pyproject.toml may change the extras too).
$(TESTING): $(RUNTIME)
	$(BIN)/pip install -e '.[test]'
	touch $@

run: setup
	$(BIN)/mxflux train

# One pytest worker per core (pytest-xdist), each on one thread (tests/conftest.py): most of the suite's time is
# `mxflux` processes starting and training tiny runs on one thread, which two workers run side by side
# (205-426 s in a fresh clone on 2 cores, against 861-1098 s serially).
test: setup-test
	$(BIN)/python -m pytest -q -n auto

# The compiled and distributed end-to-end tests `make test` skips (marked slow: up to minutes each on 2
# cores), one pytest worker per core as in `make test`.
test-slow: setup-test
	$(BIN)/python -m pytest -q -n auto --slow -m slow

# Triton (which `make test` leaves out: CI's time) in a folder of its own put ahead of the venv's packages.
# Under numpy >= 2.4 its 3.6 interpreter needs tests/triton_interpreter_fix.py, which the tests install.
KERNEL_DEPS := .kernel-deps
$(KERNEL_DEPS)/.installed: $(TESTING)
	$(BIN)/pip install --no-deps --target $(KERNEL_DEPS) triton==3.6.0
	touch $@

test-kernels: $(KERNEL_DEPS)/.installed
	TRITON_INTERPRET=1 PYTHONPATH=$(KERNEL_DEPS) $(BIN)/python -m pytest -q tests/gpu
	PYTHONPATH=$(KERNEL_DEPS) $(BIN)/python -m pytest -q tests/gpu/test_triton_compile.py

# CuTe DSL (the row-scaled GEMM taken where installed, mxflux.kernels.gemm_cute) in a folder of its own, as Triton above;
# its packages sit one level down (the wheel adds them by a .pth file, which --target skips).
# quack-kernels (benchmarks/probe_quack_gemm.py's ping-pong GEMM) beside it, without its torch: the one installed.
CUTE_DEPS := .cute-deps
$(CUTE_DEPS)/.installed: $(TESTING)
	$(BIN)/pip install --target $(CUTE_DEPS) "nvidia-cutlass-dsl==4.8.1"
	touch $@

$(CUTE_DEPS)/.quack-installed: $(CUTE_DEPS)/.installed
	$(BIN)/pip install --target $(CUTE_DEPS) --no-deps "quack-kernels==0.6.5" "apache-tvm-ffi>=0.1.6,<0.2" einops \
	  torch-c-dlpack-ext
	touch $@

test-cute: $(CUTE_DEPS)/.quack-installed $(KERNEL_DEPS)/.installed
	PYTHONPATH=$(CUTE_DEPS):$(CUTE_DEPS)/nvidia_cutlass_dsl/dsl_packages:$(KERNEL_DEPS) $(BIN)/python -m pytest -q \
	  tests/test_cute_gemm_layout.py tests/test_benchmark_scripts.py -k "cute or quack"

clean:
	rm -rf $(VENV) $(KERNEL_DEPS) $(CUTE_DEPS) build src/*.egg-info .pytest_cache .hypothesis

# Set-up and tests. `make test` and `make smoke` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# The wheel index torch alone is installed from (e.g. one of a CUDA version); empty: pip's
# own index, where PIP_INDEX_URL / PIP_EXTRA_INDEX_URL in the environment are honoured.
TORCH_INDEX_URL ?=

.PHONY: setup test test-fast typecheck lint format check smoke bench bench-sbi bench-posterior clean

setup: $(VENV)/.ready

# The venv sees the system's site-packages so an installed torch (a GPU box with
# no network) is reused; torch is installed only when none can be imported.
# The editable install builds the C extension _probes in place; without a working
# compiler it is skipped and one line says that probes use the Python fallback.
# `. .venv/bin/activate` puts `python` and `torchrun` of the venv first on PATH, as the
# documents assume: a torch installed outside the venv has its torchrun outside it, so the
# venv then gets a torchrun of its own that runs torch.distributed.run with the venv's python.
$(VENV)/.ready: pyproject.toml setup.py _probes.c
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH)"
	$(PY) -c "import numpy, pytest, hypothesis, packaging" 2>/dev/null \
		|| $(PY) -m pip install numpy pytest hypothesis packaging
	$(PY) -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 70)" 2>/dev/null \
		|| $(PY) -m pip install "setuptools>=70.1"
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install matplotlib \
		|| echo "matplotlib (optional) is unavailable: figure tests will be skipped"
	$(PY) -m pip install --no-deps --no-build-isolation -e . >/dev/null
	@test -x $(VENV)/bin/torchrun || { printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$$@"\n' \
		"$(abspath $(PY))" >$(VENV)/bin/torchrun && chmod +x $(VENV)/bin/torchrun; }
	@$(PY) -c "import _probes" 2>/dev/null || echo "nnpd: C extension _probes not built (no working C compiler?); probes use the pure-Python fallback"
	touch $@

test: setup
	$(PY) -m pytest -q tests

# The fast loop: the unit and property layers, in-process (README.md, "Tests and benchmarks").
# One intra-op thread, as nnpd's launches run by default (runtime.cpu_threads): the layers'
# small tensor operations spend more on waking a second thread than they gain, on a busy machine most.
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "unit or property" tests

# mypy on the kit's public modules (the list and the strictness, default mypy plus
# check_untyped_defs, warn_unused_ignores and warn_redundant_casts, are in pyproject.toml's [tool.mypy]). mypy is
# installed into the venv here, when the check runs: it is no dependency of nnpd, nor part of setup.
typecheck: setup
	$(PY) -c "import mypy" 2>/dev/null || $(PY) -m pip install mypy
	$(PY) -m mypy

# ruff for development only, installed into the venv when the target runs (like mypy): `lint`
# checks the whole tree against pyproject.toml's [tool.ruff] and that it is formatted; `format`
# formats it and sorts its imports.
lint: setup
	$(PY) -c "import ruff" 2>/dev/null || $(PY) -m pip install ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -c "import ruff" 2>/dev/null || $(PY) -m pip install ruff
	$(PY) -m ruff check --select I --fix .
	$(PY) -m ruff format .

# What to run before a commit: the fast layers, the types and the style.
check: test-fast typecheck lint

smoke: setup
	$(PY) nnpd.py run --profile smoke

# The posterior-quality bench is left out: it needs sbi and hours of CPU (bench-posterior).
bench: setup
	for b in $(filter-out bench/bench_posterior_quality.py,$(wildcard bench/bench_*.py)); do $(PY) $$b || exit 1; done

# sbi only in the bench's own venv, bench/.venv-sbi, over .venv's torch (never a dependency of nnpd).
bench-sbi: setup
	$(PY) bench/bench_posterior_quality.py --sbi-setup

# nnpd against sbi's NRE_A and NRE_C on exact posteriors; ARGS="--quick" for a fast check.
bench-posterior: bench-sbi
	OMP_NUM_THREADS=1 $(PY) bench/bench_posterior_quality.py $(ARGS)

clean:
	rm -rf $(VENV) bench/.venv-sbi bench/.venv-sbi.lock outputs build *.egg-info .pytest_cache _probes.*.so

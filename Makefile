# Every target builds its own virtualenv from pinned requirements on first use.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: venv test demo examples bench acceptance clean matrix matrix-envs verl-bench-env install-check

$(VENV)/.installed: requirements/py311.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/py311.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

test: venv  ## run the test suite
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The whole suite on megatron-core 0.14.0 - 0.19.2 (scripts/matrix.py): the Python 3.11 releases in
# $(VENV) with each release first on PYTHONPATH (.mcore/<version>), the Python 3.12 releases in
# .venv-py312 from a Python 3.12 interpreter (PY312=..., default python3.12 on PATH). A requested
# release that cannot run (no Python 3.12) fails the target; ALLOW_SKIP=1 reports it and goes on.
# MATRIX_VERSIONS=0.14.0,0.19.2 picks releases; results in matrix-out/.
MATRIX_OPTS = $(if $(PY312),--python312 $(PY312)) $(if $(MATRIX_VERSIONS),--versions $(MATRIX_VERSIONS)) $(if $(ALLOW_SKIP),--allow-skip)

matrix: venv  ## run the test suite on every supported megatron-core release
	$(PY) scripts/matrix.py --python311 $(PY) $(MATRIX_OPTS) -- $(PYTEST_ARGS)

matrix-envs: venv  ## build the matrix environments only
	$(PY) scripts/matrix.py --python311 $(PY) $(MATRIX_OPTS) --build-only

# verl 0.9.1 for the benchmark's verl variant (benchmarks/verl_baseline.py): pinned, --no-deps, into .verl/py311.
VERL_BENCH := .verl/py311
$(VERL_BENCH)/.installed: requirements/verl-bench.txt | venv
	rm -rf $(VERL_BENCH)
	VERL_USE_EXTERNAL_PLUGINS=none $(PY) -m pip install -q --no-deps --target $(VERL_BENCH) -r requirements/verl-bench.txt
	touch $@

verl-bench-env: $(VERL_BENCH)/.installed  ## verl 0.9.1 for make bench's verl variant (without it the variant is skipped, with the reason)

bench: venv  ## the main job: benchmark against stock mcore and verl (exact FLOPs, memory, syncs, H2D; timed rounds). BENCH_ARGS=--quick: seconds-long shapes, exact goals checked
	$(PY) -m benchmarks $(BENCH_ARGS)

install-check:  ## the README's install commands in a fresh virtualenv (scripts/check_install.sh)
	PYTHON=$(PYTHON) scripts/check_install.sh

acceptance: venv  ## draft acceptance through an RL run over 3 seeds: frozen MTP vs ce / distill / tv (ACCEPTANCE_ARGS=--quick: a few minutes)
	$(PY) -m benchmarks.acceptance $(ACCEPTANCE_ARGS)

demo: venv  ## tiny CPU model: train MTP on some micro-batches, skip it on others, check against stock
	$(PY) -m benchmarks.demo

examples: venv  ## run examples/quickstart.py and examples/rl_step.py
	$(PY) examples/quickstart.py
	$(PY) examples/rl_step.py

clean:
	rm -rf $(VENV) bench-out .verl

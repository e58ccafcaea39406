# Every target builds its own virtualenv from pinned requirements on first use.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: venv test demo bench clean

$(VENV)/.installed: requirements/py311.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/py311.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

test: venv  ## run the test suite
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: venv  ## tiny CPU model: train MTP on some micro-batches, skip it on others, check against stock
	$(PY) -m benchmarks.demo

clean:
	rm -rf $(VENV) bench-out

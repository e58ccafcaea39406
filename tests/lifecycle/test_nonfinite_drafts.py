"""Own drafts from non-finite states: NaN losses as stock reports them, never a crash.

With ``draft_inputs="argmax"`` / ``"sample"`` each draft step embeds the token the previous step's
hidden state drafts. A NaN or inf before the draft (in the trunk, in an MTP layer, an overflowing
logit, a NaN row of the output weight) must give what stock and the teacher-forced chain give: NaN
MTP losses a loss scaler skips, no out-of-range token id in the embedding (an ``IndexError`` on the
CPU, a device-side assert on a GPU, a silent zero embedding at TP > 1), and the model stock after
the forward. One process, then TP = 2 on two gloo ranks.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.testing import TinyGPT, hooked_train_step, make_batch, masked_mean
from tests.support.distributed import SpawnedGroup

VOCAB = 64


def _nan_in_trunk(model: nn.Module) -> None:
    model.decoder.layers[0].mlp.linear_fc1.weight.data[0, 0] = math.nan


def _nan_in_mtp_layer(model: nn.Module) -> None:
    model.mtp.layers[0].eh_proj.weight.data[0, 0] = math.nan


def _overflowing_logit(model: nn.Module) -> None:
    model.output_layer.weight.data[3] = 3e38  # the logits of token 3 overflow to +-inf


def _nan_output_row(model: nn.Module) -> None:
    model.output_layer.weight.data[5] = math.nan


FAULTS: dict[str, Callable[[nn.Module], None]] = {
    "trunk": _nan_in_trunk,
    "mtp_layer": _nan_in_mtp_layer,
    "overflow": _overflowing_logit,
    "output_row": _nan_output_row,
}


def _stock_losses(fault: Callable[[nn.Module], None], steps: int) -> list[float]:
    """The teacher-forced chain's MTP losses on the faulty model (the hooks' own reference path)."""
    model = TinyGPT(vocab_size=VOCAB).build()
    fault(model)
    hooks = mtp_hooks.attach(model, draft_steps=steps)
    hooked_train_step(model, hooks, make_batch(VOCAB, batch=2, seq=8))
    metrics = hooks.metrics()
    return [metrics[f"mtp_{k}/loss"] for k in range(1, steps + 1)]


def _own_draft_losses(fault: Callable[[nn.Module], None], steps: int, inputs: str) -> tuple[list[float], nn.Module]:
    model = TinyGPT(vocab_size=VOCAB).build()
    fault(model)
    options: dict[str, Any] = {"draft_steps": steps, "draft_inputs": inputs}
    if inputs == "sample":
        options["draft_temperature"] = 0.7
    hooks = mtp_hooks.attach(model, **options)
    hooked_train_step(model, hooks, make_batch(VOCAB, batch=2, seq=8))
    metrics = hooks.metrics()
    return [metrics[f"mtp_{k}/loss"] for k in range(1, steps + 1)], model


def _same_finiteness(own: list[float], teacher_forced: list[float]) -> bool:
    return [math.isfinite(x) for x in own] == [math.isfinite(x) for x in teacher_forced]


@pytest.mark.parametrize("inputs", ["argmax", "sample"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_own_drafts_from_non_finite_states_give_nan_losses_not_a_crash(fault: str, inputs: str) -> None:
    teacher_forced = _stock_losses(FAULTS[fault], steps=3)
    own, model = _own_draft_losses(FAULTS[fault], steps=3, inputs=inputs)
    assert not all(math.isfinite(x) for x in own), "the fault reached no MTP loss"
    assert _same_finiteness(own, teacher_forced), (own, teacher_forced)
    assert model.config.mtp_num_layers == 2 and model.mtp_process  # left stock


def test_a_nan_output_row_drafts_the_first_nan_id_like_torch_argmax() -> None:
    """A NaN counts as the maximum, as in ``torch.argmax`` of the gathered logits: the draft is the
    NaN column's id, a real token."""
    from mtp_hooks.ops.drafts import draft_tokens

    weight = torch.randn(8, 4)
    weight[5] = math.nan
    tokens = draft_tokens(torch.randn(3, 4), weight, None, 2, None)
    assert tokens.tolist() == [5, 5, 5]


# ------------------------------------------------------------------ TP = 2


def scenario_tensor_parallel_faults(fault: str) -> list[float]:
    """Rank-local: the faulty model at TP = 2 with own argmax drafts; its MTP losses."""
    from megatron.core import parallel_state

    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    model = TinyGPT(vocab_size=VOCAB).build()
    FAULTS[fault](model)
    hooks = mtp_hooks.attach(model, draft_steps=3, draft_inputs="argmax")
    batch = make_batch(VOCAB, batch=2, seq=8)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)  # [b, s, V/tp]
    masked_mean(vocab_parallel_cross_entropy(logits.float(), batch.labels), batch.loss_mask).backward()
    metrics = hooks.metrics()
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    return [metrics[f"mtp_{k}/loss"] for k in range(1, 4)]


def scenario_tensor_parallel_nan_draft() -> list[int]:
    """Rank-local: the drafts of a head whose full weight has a NaN row (id 37, on rank 1's shard)."""
    from megatron.core import parallel_state

    from mtp_hooks.ops.drafts import draft_tokens

    weight = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(0))
    weight[37] = math.nan
    rank, shard = parallel_state.get_tensor_model_parallel_rank(), VOCAB // 2
    group = parallel_state.get_tensor_model_parallel_group()
    return draft_tokens(torch.randn(3, 4), weight[rank * shard : (rank + 1) * shard], group, 2, None).tolist()


def test_tensor_parallel_nan_logits_draft_a_real_id_on_every_rank(group: SpawnedGroup) -> None:
    """Not ``NO_INDEX``, which a vocab-parallel embedding would silently turn into a zero embedding."""
    assert group.run(scenario_tensor_parallel_nan_draft, {"tensor_model_parallel_size": 2}) == [[37, 37, 37]] * 2


@pytest.mark.parametrize("fault", ["trunk", "output_row"])
def test_tensor_parallel_own_drafts_from_non_finite_states_give_nan_losses(group: SpawnedGroup, fault: str) -> None:
    per_rank = group.run(scenario_tensor_parallel_faults, {"tensor_model_parallel_size": 2}, fault=fault)
    assert not any(math.isfinite(x) for x in per_rank[0])
    assert [math.isnan(x) for x in per_rank[0]] == [math.isnan(x) for x in per_rank[1]]

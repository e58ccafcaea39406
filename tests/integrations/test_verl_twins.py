"""``attach_engine_mtp`` against verl 0.9.1's own ``patch_engine_mtp``, twin models side by side.

One twin is wired by verl's patch (imported from the installed package), the other by
``mtp_hooks.integrations.verl.attach_engine_mtp``; both get the same call verl's engine makes
(``labels`` / ``loss_mask`` kwargs, ``packed_seq_params`` for THD) and the same main loss from the
returned logits. Dense: logits, mcore's MTP tracker and every gradient bit-equal. Lean: within
rounding. Runs on whichever megatron-core is installed (``make test-verl``: 0.16.1 and 0.19.2).
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from mtp_hooks import _mcore
from mtp_hooks.integrations.verl import NORMALIZATION_FACTOR_ATTR, attach_engine_mtp, verl_options
from mtp_hooks.testing import TinyGPT, grads_of, main_ce_from_logits, masked_mean
from tests.support.mcore_cpu import MTP_RECOMPUTE_BROKEN
from tests.lifecycle.test_modes import cuda_rng_on_cpu  # noqa: F401  (fixture)
from tests.support.verl_support import import_verl, model_config

verl = import_verl()

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 48
LENGTHS = [6, 5, 4]  # THD: three sequences in one row
FACTOR = 1.46  # a routed / loss token factor as verl's engine sets it (THD, per-token loss)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
LEGACY = not _mcore.PER_TOKEN_LOSS_RESCALED  # no process_mtp_loss: verl's own MTP loop


@dataclasses.dataclass
class Inputs:
    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    loss_mask: Tensor
    packed: Optional[PackedSeqParams]

    def call(self) -> dict[str, Any]:
        """The model call of verl's engine (``gptmodel_forward_model_engine``)."""
        return dict(
            input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None,
            labels=self.labels, loss_mask=self.loss_mask, packed_seq_params=self.packed,
        )


def make_inputs(layout: str, mask: str = "random", seed: int = 0, factor: Optional[float] = None) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    if layout == "bshd":
        b, s = 2, 9
        ids = torch.randint(0, VOCAB, (b, s), generator=gen)
        positions = torch.arange(s).expand(b, s).contiguous()
        labels, packed = torch.roll(ids, -1, 1), None
    else:
        s = sum(LENGTHS)
        ids = torch.randint(0, VOCAB, (1, s), generator=gen)
        positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
        labels = torch.roll(ids, -1, 1)
        cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
        if factor is not None:
            setattr(packed, NORMALIZATION_FACTOR_ATTR, factor)
    if mask == "random":
        loss_mask = (torch.rand(ids.shape, generator=gen) > 0.3).float()
    elif mask == "last":  # only the last token counts: every MTP depth is empty
        loss_mask = torch.zeros(ids.shape)
        loss_mask[:, -1] = 1
    else:
        raise ValueError(mask)
    return Inputs(ids, positions, labels, loss_mask, packed)


def train_step(model: nn.Module, inputs: Inputs) -> tuple[Tensor, dict[str, Tensor]]:
    """One training micro-batch as verl's engine runs it; returns the logits and mcore's MTP tracker."""
    MTPLossLoggingHelper.tracker.clear()
    logits = model(**inputs.call())
    masked_mean(main_ce_from_logits(logits, inputs.labels), inputs.loss_mask).backward()
    tracker = {k: v.detach().clone() for k, v in MTPLossLoggingHelper.tracker.items() if isinstance(v, Tensor)}
    MTPLossLoggingHelper.tracker.clear()
    return logits.detach(), tracker


def wrap(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    return Float16Module(model.config, model) if dtype == torch.bfloat16 else model


def twins(shape: TinyGPT, detach_encoder: bool, **options: Any) -> tuple[nn.Module, nn.Module, list[mtp_hooks.MTPHooks]]:
    """(verl-patched model, hooked model, hooks) with the same weights."""
    config = model_config(verl, detach_encoder)
    patched, hooked = wrap(shape.build(7), shape.params_dtype), wrap(shape.build(7), shape.params_dtype)
    verl.megatron_utils.patch_engine_mtp(patched, config)
    return patched, hooked, attach_engine_mtp(hooked, config, **options)


def assert_twins_equal(patched: nn.Module, hooked: nn.Module, inputs: Inputs, exact: bool, bf16: bool = False) -> None:
    verl_logits, verl_tracker = train_step(patched, inputs)
    logits, tracker = train_step(hooked, inputs)
    assert torch.equal(logits, verl_logits), "main logits differ from verl's"
    assert tracker.keys() == verl_tracker.keys() and tracker, f"tracker keys {sorted(tracker)} vs verl's {sorted(verl_tracker)}"
    for key, value in verl_tracker.items():
        if exact:
            assert torch.equal(tracker[key], value), f"tracker[{key!r}]: {tracker[key]} vs verl's {value}"
        else:
            torch.testing.assert_close(tracker[key], value, rtol=2**-7 if bf16 else 1e-5, atol=1e-6, msg=lambda m: f"tracker[{key!r}]: {m}")
    expected, actual = grads_of(patched), grads_of(hooked)
    assert expected.keys() == actual.keys()
    for name, ref in expected.items():
        grad = actual[name]
        if ref is None or grad is None:
            assert (grad if ref is None else ref) is None or not (grad if ref is None else ref).any(), f"{name}: one gradient is None"
        elif exact:
            assert torch.equal(grad, ref), f"{name}: max |diff| {(grad.float() - ref.float()).abs().max().item():.3g}"
        elif bf16:
            torch.testing.assert_close(grad, ref, rtol=2 * 2**-7, atol=2**-7 * ref.abs().max().item(), msg=lambda m: f"{name}: {m}")
        else:
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def shape_for(depth: int, tied: bool, per_token: bool, dtype: torch.dtype = torch.float32, **overrides: Any) -> TinyGPT:
    small = dtype == torch.bfloat16
    return TinyGPT(
        vocab_size=VOCAB, hidden_size=16 if small else 32, num_layers=1 if small else 2, mtp_num_layers=depth, tied=tied,
        params_dtype=dtype, config_overrides=dict(calculate_per_token_loss=per_token, **overrides),
    )


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
@pytest.mark.parametrize("detach_encoder", [False, True], ids=["attached", "detach_encoder"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_dense_equals_verl_patch_bit_for_bit(layout: str, depth: int, tied: bool, detach_encoder: bool, per_token: bool) -> None:
    patched, hooked, _hooks = twins(shape_for(depth, tied, per_token), detach_encoder, loss_impl="dense")
    assert_twins_equal(patched, hooked, make_inputs(layout, factor=FACTOR if per_token else None), exact=True)


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
@pytest.mark.parametrize("detach_encoder", [False, True], ids=["attached", "detach_encoder"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_lean_equals_verl_patch_within_rounding(layout: str, depth: int, detach_encoder: bool, per_token: bool) -> None:
    patched, hooked, _hooks = twins(shape_for(depth, tied=depth == 2, per_token=per_token), detach_encoder)
    assert_twins_equal(patched, hooked, make_inputs(layout, factor=FACTOR if per_token else None), exact=False)


@pytest.mark.parametrize("loss_impl", ["dense", "lean"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_empty_depths_equal_verl_patch(layout: str, loss_impl: str) -> None:
    patched, hooked, _hooks = twins(shape_for(2, tied=False, per_token=False), True, loss_impl=loss_impl)
    assert_twins_equal(patched, hooked, make_inputs(layout, mask="last"), exact=loss_impl == "dense")


@pytest.mark.skipif(MTP_RECOMPUTE_BROKEN is not None, reason=str(MTP_RECOMPUTE_BROKEN))
@pytest.mark.usefixtures("cuda_rng_on_cpu")
@pytest.mark.parametrize("detach_encoder", [False, True], ids=["attached", "detach_encoder"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_full_recompute_equals_verl_patch(layout: str, detach_encoder: bool) -> None:
    """THD + full recompute crashes stock 0.16.1 (save_for_backward gets the PackedSeqParams);
    verl patches ``_checkpointed_forward``, the hooks run those MTP layers without recompute."""
    shape = shape_for(2, tied=False, per_token=False, **RECOMPUTE)
    patched, hooked, _hooks = twins(shape, detach_encoder, loss_impl="dense")
    assert_twins_equal(patched, hooked, make_inputs(layout), exact=True)


@pytest.mark.skipif(not _mcore.RECOMPUTE_SAVES_PACKED_SEQ_PARAMS, reason="this megatron-core's MTP recompute takes packed batches")
@pytest.mark.usefixtures("cuda_rng_on_cpu")
def test_thd_full_recompute_crashes_stock_so_the_fallback_is_needed() -> None:
    """Guard for the test above: the stock MTP layer refuses THD under full recompute here."""
    model = shape_for(2, tied=False, per_token=False, **RECOMPUTE).build(7)
    inputs = make_inputs("thd")
    with pytest.raises(TypeError, match="save_for_backward"):
        model(**inputs.call())


@pytest.mark.parametrize("loss_impl", ["dense", "lean"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_bf16_equals_verl_patch(layout: str, loss_impl: str) -> None:
    patched, hooked, _hooks = twins(shape_for(2, tied=True, per_token=False, dtype=torch.bfloat16), True, loss_impl=loss_impl)
    assert_twins_equal(patched, hooked, make_inputs(layout), exact=loss_impl == "dense", bf16=True)


def semantics_knobs() -> list[tuple[str, dict[str, Any], bool]]:
    """(what, the attach option turned off, per-token loss) for each of verl's semantics on this release."""
    if LEGACY:
        return [("detached head", dict(detach_head=False), False), ("per-token rescale", dict(per_token_rescale=False), True)]
    return [("normalisation factor", dict(call_loss_scale=None), True)]


@pytest.mark.parametrize("what,override,per_token", semantics_knobs(), ids=[k[0] for k in semantics_knobs()])
def test_each_verl_semantic_is_needed(what: str, override: dict[str, Any], per_token: bool) -> None:
    """Guard for the equality tests: without the option that reproduces it, the gradients differ from verl's."""
    patched, hooked, _hooks = twins(shape_for(2, tied=False, per_token=per_token), False, loss_impl="dense", **override)
    with pytest.raises(AssertionError, match="max |diff|"):
        assert_twins_equal(patched, hooked, make_inputs("thd", factor=FACTOR), exact=True)


def test_options_follow_the_installed_release() -> None:
    config = model_config(verl, True)
    plain = shape_for(1, tied=False, per_token=False).config()
    per_token = shape_for(1, tied=False, per_token=True).config()
    assert verl_options(config, plain) == dict(detach_encoder=True, detach_head=LEGACY, per_token_rescale=True)
    assert ("call_loss_scale" in verl_options(config, per_token)) is not LEGACY
    assert NORMALIZATION_FACTOR_ATTR == verl.mtp_patch._MTP_LOSS_NORMALIZATION_FACTOR_ATTR


def test_a_factor_that_is_not_positive_is_refused_like_verl() -> None:
    if LEGACY:
        pytest.skip("megatron-core without process_mtp_loss: verl's legacy loop ignores the factor")
    _patched, hooked, _hooks = twins(shape_for(1, tied=False, per_token=True), False)
    with pytest.raises(mtp_hooks.MTPHooksError, match=NORMALIZATION_FACTOR_ATTR):
        hooked(**make_inputs("thd", factor=0.0).call())


def test_refused_model_config_names_the_argument() -> None:
    model = shape_for(1, tied=False, per_token=False).build(7)
    with pytest.raises(mtp_hooks.MTPHooksError, match="model_config"):
        attach_engine_mtp(model, object())
    assert mtp_hooks.hooks_of(model) is None


def test_attach_engine_mtp_attaches_every_chunk_and_remove_restores_stock() -> None:
    shape = shape_for(1, tied=False, per_token=False)
    chunks = [shape.build(7), shape.build(8)]
    hooks = attach_engine_mtp(chunks, model_config(verl, True))
    assert [h.model for h in hooks] == chunks and all(mtp_hooks.hooks_of(c) is h for c, h in zip(chunks, hooks))
    for h in hooks:
        h.remove()
    assert all(mtp_hooks.hooks_of(c) is None for c in chunks)


def readme_switch() -> str:
    """The "after" block of the verl migration guide (docs/verl.md; the one the user pastes into verl)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "verl.md").read_text()
    block = text.split("<!-- verl:switch -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return textwrap.dedent(block)


def test_readme_switch_is_one_import_and_one_call_and_trains_like_verl() -> None:
    code = readme_switch()
    assert [line.split()[0] for line in code.splitlines()] == ["if", "from", "self.mtp_hooks"], code
    config = model_config(verl, True)
    patched, hooked = shape_for(2, tied=False, per_token=False).build(7), shape_for(2, tied=False, per_token=False).build(7)
    verl.megatron_utils.patch_engine_mtp(patched, config)
    engine = types.SimpleNamespace(module=[hooked], model_config=config)  # verl's engine at that line
    exec(code, {}, {"self": engine})
    assert [h.model for h in engine.mtp_hooks] == [hooked]
    assert_twins_equal(patched, hooked, make_inputs("thd"), exact=False)


def test_dynamic_cp_group_of_the_micro_batch_serves_the_embedding_path_and_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``packed_seq_params.cp_group`` (dynamic CP) the MTP layers' shifted ids and the target
    rolls use that group, as verl does; the layer's own group is back after the forward. (One
    process: the group has one rank, so the values equal verl's and what is pinned is the group.)"""
    dynamic = torch.distributed.new_group([0], backend="gloo")
    patched, hooked, _hooks = twins(shape_for(2, tied=False, per_token=False), True, loss_impl="dense")
    inputs = make_inputs("thd")
    inputs.packed = dataclasses.replace(inputs.packed, cp_group=dynamic)
    layer = hooked.mtp.layers[0]
    static = layer.cp_group
    seen: list[Any] = []
    hooked.embedding.register_forward_pre_hook(lambda m, a: seen.append(layer.cp_group) if hooked.mtp.layers[0] is layer else None)
    rolls: list[Any] = []
    roll = _mcore.roll_left
    monkeypatch.setattr(_mcore, "roll_left", lambda t, group, packed: (rolls.append(group), roll(t, group, packed))[1])
    assert_twins_equal(patched, hooked, inputs, exact=True)
    assert dynamic in seen and layer.cp_group is static
    assert rolls and all(group is dynamic for group in rolls)

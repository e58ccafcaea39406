"""verl 0.9.1's Megatron -> rollout weight export (``per_tensor_generator``) of trained MTP weights.

A hooked and a stock twin (same weights) train through the same steps side by side; verl's
``per_tensor_generator`` (PP broadcast, TP gather and QKV / gate-up split, name normalisation)
exports both, while the hooks are attached and after ``remove()``: the same names and values
(to float rounding: the main CE is the user's, from logits), MTP layers included, dense and lean. verl's name converters have no MTP mapping but DeepSeek-V3's
(MLA, one layer), so the converter here keeps mcore's names: the export step under test is verl's
traversal and gathering, which decides which tensors leave and with what values.
"""

from __future__ import annotations

import types

import pytest
import torch

import mtp_hooks
from mtp_hooks.testing import TinyGPT, cuda_calls_on_cpu, hooked_train_step, make_batch, stock_train_step
from tests.support.verl_support import import_verl

import_verl()

from verl.utils.megatron_utils import per_tensor_generator  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPE = TinyGPT()


class KeepNames:
    """A weight converter that keeps mcore's names (split tensors numbered)."""

    hf_config = None

    def convert_param(self, name: str, params: list[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
        return ([name] if len(params) == 1 else [f"{name}[{i}]" for i in range(len(params))]), params


def export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model_config = types.SimpleNamespace(tie_word_embeddings=SHAPE.tied, num_attention_heads=SHAPE.num_attention_heads, num_key_value_heads=SHAPE.num_attention_heads)
    mapping = {"qkv_layer_name": "self_attention.linear_qkv", "gate_proj_layer_name": "linear_fc1.weight"}
    with cuda_calls_on_cpu():
        pairs = list(per_tensor_generator([model], model_config, KeepNames(), model.config, mapping))
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)), "an exported name repeats"
    return {name: tensor.detach().clone() for name, tensor in pairs}


@pytest.mark.parametrize("loss_impl", ["dense", "lean"])
def test_trained_mtp_weights_leave_under_stock_names_and_values_while_attached_and_after_remove(loss_impl: str) -> None:
    stock, hooked = SHAPE.build(seed=5), SHAPE.build(seed=5)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (stock, hooked)]
    for step in range(3):
        batch = make_batch(SHAPE.vocab_size, batch=2, seq=16, seed=step)
        stock_train_step(stock, batch)
        hooked_train_step(hooked, hooks, batch)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    initial = export(SHAPE.build(seed=5))
    reference = export(stock)
    mtp_names = [name for name in reference if name.startswith("mtp.")]
    assert mtp_names and all(not torch.equal(reference[n], initial[n]) for n in mtp_names if "norm" not in n), "MTP did not train"
    for when in ("attached", "removed"):
        if when == "removed":
            hooks.remove()
        exported = export(hooked)
        assert list(exported) == list(reference), when
        for name, tensor in reference.items():
            # The user's main CE from logits is not stock's fused per-token loss: equal up to float rounding.
            torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{when}: {n}: {m}")

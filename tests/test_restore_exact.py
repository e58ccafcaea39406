"""No method replaced, and ``remove()`` gives back stock mcore bit for bit.

Probes run before attach, from inside hooked forwards (pre-hooks the test registers on the
output layer, an MTP layer and the decoder, so they fire while every temporary swap is live) and
after remove:

* every module keeps its class and identity, and no instance attribute shadows a routine of its
  class (``forward``, ``_postprocess``, ``_get_embeddings``, ...);
* every class in the model's MROs (and the config's) keeps the same namespace, object for object;
* every function and class bound in an imported ``megatron.*`` module is still the same object;
* the only instance attributes that may differ while a forward runs are ``config`` (a view of
  the original config) and the ``mtp_process`` flag, both on the language model only; after the
  forward both are the original objects again.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.mcore_cpu import (
    Batch,
    TinyGPT,
    grads_of,
    main_ce_from_logits,
    make_batch,
    masked_mean,
    output_layer_calls,
    stock_mtp_losses,
)

VOCAB = 64
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


# --------------------------------------------------------------------------- probes


def modules_snapshot(model: nn.Module) -> dict[str, tuple[nn.Module, type, dict[str, Any]]]:
    """Per module name: the module, its class and a shallow copy of its ``__dict__``."""
    return {name: (m, type(m), dict(vars(m))) for name, m in model.named_modules()}


def shadowed_routines(model: nn.Module) -> list[str]:
    """Instance attributes that hide a function / method of the module's class."""
    found = []
    for name, module in model.named_modules():
        for key in vars(module):
            static = None
            for cls in type(module).__mro__:
                if key in vars(cls):
                    static = vars(cls)[key]
                    break
            if inspect.isfunction(static) or isinstance(static, (staticmethod, classmethod)):
                found.append(f"{name or '<model>'}.{key}")
    return found


def class_namespaces(model: nn.Module) -> dict[type, dict[str, Any]]:
    classes = {cls for m in model.modules() for cls in type(m).__mro__}
    classes |= set(type(model.config).__mro__)
    return {cls: dict(vars(cls)) for cls in classes if cls is not object}


def megatron_bindings() -> dict[tuple[str, str], Any]:
    """Every function and class bound at the top level of an imported ``megatron`` module."""
    out = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron"):
            continue
        for key, value in list(vars(module).items()):
            if inspect.isroutine(value) or inspect.isclass(value):
                out[(module_name, key)] = value
    return out


def hook_dicts(model: nn.Module) -> dict[str, dict[str, dict[Any, Any]]]:
    out = {name: {d: dict(getattr(m, d)) for d in HOOK_DICTS} for name, m in model.named_modules()}
    out["<global>"] = {d: dict(getattr(nn.modules.module, d)) for d in GLOBAL_HOOK_DICTS}
    return out


class Probe:
    """Everything the probes see before attach; ``check`` compares a later view against it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.modules = modules_snapshot(model)
        self.classes = class_namespaces(model)
        self.bindings = megatron_bindings()
        self.shadowed = shadowed_routines(model)

    def check(self, where: str, swapped: frozenset[str] = frozenset()) -> list[str]:
        """Problems found now; ``swapped``: language-model attributes allowed to differ right now."""
        problems = []
        now = modules_snapshot(self.model)
        if now.keys() != self.modules.keys():
            problems.append(f"{where}: module tree changed: {sorted(now.keys() ^ self.modules.keys())}")
        for name, (module, cls, attrs) in self.modules.items():
            if name not in now:
                continue
            module_now, cls_now, attrs_now = now[name]
            if module_now is not module or cls_now is not cls or type(module_now) is not cls:
                problems.append(f"{where}: module {name!r} or its class was replaced")
            allowed = swapped if module is self.model else frozenset()
            if attrs_now.keys() - {"_mtp_hooks"} != attrs.keys():
                problems.append(f"{where}: {name!r} attributes changed: {sorted(attrs_now.keys() ^ attrs.keys())}")
            for key, value in attrs.items():
                if key in allowed or key not in attrs_now:
                    continue
                if key in ("_parameters", "_buffers", "_modules"):
                    if attrs_now[key] is not value or dict(attrs_now[key]) != dict(value):
                        problems.append(f"{where}: {name!r}.{key} changed")
                elif attrs_now[key] is not value and not _same_plain_value(attrs_now[key], value):
                    problems.append(f"{where}: {name!r}.{key} is another object")
        if shadowed_routines(self.model) != self.shadowed:
            problems.append(f"{where}: instance attributes shadow class routines: {shadowed_routines(self.model)}")
        for cls, namespace in self.classes.items():
            current = dict(vars(cls))
            changed = [k for k in namespace.keys() | current.keys() if namespace.get(k, None) is not current.get(k, None)]
            if changed:
                problems.append(f"{where}: class {cls.__qualname__} changed: {sorted(changed)}")
        bindings = megatron_bindings()
        rebound = [f"{m}.{k}" for (m, k), v in self.bindings.items() if bindings.get((m, k)) is not v]
        if rebound:
            problems.append(f"{where}: megatron bindings replaced: {rebound[:10]}")
        if "config" in swapped:
            view = self.model.config
            if view is self.config or getattr(view, "__wrapped__", None) is not self.config or view.mtp_num_layers is not None:
                problems.append(f"{where}: config during forward is not a view of the original reading no MTP layers")
        elif self.model.config is not self.config:
            problems.append(f"{where}: model.config is not the original object")
        return problems


def _same_plain_value(a: Any, b: Any) -> bool:
    """Immutable scalars (bools, ints, strings) may be equal copies; anything else must be the same object."""
    return type(a) is type(b) and isinstance(a, (bool, int, float, str, type(None))) and a == b


SWAPPABLE = frozenset({"config", "mtp_process"})


def add_forward_probes(model: nn.Module, probe: Probe, found: list[str]) -> list[Any]:
    """Pre-hooks that run the probe in the middle of a forward (decoder, first MTP layer, output layer)."""
    handles = []
    targets = [("decoder", model.decoder), ("output_layer", model.output_layer), ("mtp.layers.0", model.mtp.layers[0])]
    for where, module in targets:
        def hook(_m: nn.Module, _a: tuple[Any, ...], where: str = where) -> None:
            found.append(where)
            found.extend(probe.check(f"inside {where}", SWAPPABLE))
        handles.append(module.register_forward_pre_hook(hook))
    return handles


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("detach", [False, True], ids=["plain", "detach_both"])
@pytest.mark.parametrize("impl", ["lean", "dense"])
def test_no_method_is_replaced_before_during_and_after_hooked_forwards(impl: str, detach: bool) -> None:
    model = TinyGPT(mtp_num_layers=2, tied=detach).build(seed=1)
    batch = make_batch(VOCAB, seq=8)
    probe = Probe(model)
    assert probe.check("before attach") == []
    hooks = mtp_hooks.attach(model, loss_impl=impl, detach_encoder=detach, detach_head=detach)
    assert probe.check("after attach") == []

    found: list[str] = []
    handles = add_forward_probes(model, probe, found)
    logits = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    for handle in handles:
        handle.remove()
    assert [p for p in found if p.startswith("inside")] == [], found
    assert {"decoder", "output_layer", "mtp.layers.0"} <= set(found), "a probe did not run"

    found.clear()
    handles = add_forward_probes(model, probe, found)
    with torch.no_grad():
        model(*batch.model_args)
    for handle in handles:
        handle.remove()
    assert [p for p in found if p.startswith("inside")] == [], found
    assert set(found) == {"decoder", "output_layer"}, "a probe did not run, or the MTP block ran"

    assert probe.check("after forwards") == []
    hooks.remove()
    assert probe.check("after remove") == []
    assert "_mtp_hooks" not in vars(model)


def test_probe_detects_a_replaced_method_and_a_swapped_config() -> None:
    """Control: the probe is able to fail."""
    model = TinyGPT(mtp_num_layers=1).build(seed=1)
    probe = Probe(model)
    model.output_layer.forward = lambda *a, **k: None  # what a patching library would do
    assert any("shadow" in p for p in probe.check("patched"))
    del model.output_layer.forward
    config = model.config
    model.config = type(config)(**{f: getattr(config, f) for f in ("num_layers", "hidden_size", "num_attention_heads")})
    assert any("config" in p for p in probe.check("config swapped"))
    model.config = config
    assert probe.check("restored") == []


def stock_train(model: nn.Module, batch: Batch) -> tuple[Tensor, list[float]]:
    with output_layer_calls(model) as calls:
        per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    assert len(calls) == 3, "stock MTP heads and main head must all run again"
    return per_token.detach(), stock_mtp_losses()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"loss_impl": "dense"},
        {"detach_encoder": True, "detach_head": True, "chunk_size": 3},
        {"loss_scale": 0.0},
    ],
    ids=["lean", "dense", "detach_both", "scale0"],
)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_remove_restores_outputs_gradients_state_and_hook_dicts_bit_for_bit(options: dict[str, Any], tied: bool) -> None:
    spec = TinyGPT(mtp_num_layers=2, tied=tied)
    model, never_hooked = spec.build(seed=4), spec.build(seed=4)
    batch = make_batch(VOCAB, seq=10, seed=4)
    config, keys, dicts = model.config, vars(model).keys(), hook_dicts(model)

    hooks = mtp_hooks.attach(model, **options)
    logits = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    with hooks.micro_batch(labels=batch.labels):
        model(*batch.model_args).sum().backward()
    model(*batch.model_args)
    hooks.remove()
    hooks.remove()  # twice is harmless

    model.zero_grad(set_to_none=True)
    assert model.config is config
    assert model.mtp_process is True
    assert vars(model).keys() == keys
    assert hook_dicts(model) == dicts
    assert mtp_hooks.hooks_of(model) is None
    assert all(not getattr(m, d) for m in model.modules() for d in HOOK_DICTS[:5]), "a forward hook is left"
    MTPLossLoggingHelper.tracker.clear()

    loss, losses = stock_train(model, batch)
    ref_loss, ref_losses = stock_train(never_hooked, batch)
    assert torch.equal(loss, ref_loss)
    assert losses == ref_losses and len(losses) == 2
    ours, ref = grads_of(model), grads_of(never_hooked)
    assert ours.keys() == ref.keys()
    for name in ref:
        assert ours[name] is not None and torch.equal(ours[name], ref[name]), name
    state, ref_state = model.state_dict(), never_hooked.state_dict()
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        if isinstance(value, Tensor):
            assert torch.equal(state[name], value), name


def test_attach_again_after_remove_works_like_the_first_time() -> None:
    spec = TinyGPT(mtp_num_layers=2)
    model, twin = spec.build(seed=6), spec.build(seed=6)
    batch = make_batch(VOCAB, seq=8, seed=6)
    mtp_hooks.attach(model).remove()
    hooks, twin_hooks = mtp_hooks.attach(model), mtp_hooks.attach(twin)
    for m in (model, twin):
        logits = m(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert hooks.metrics() == twin_hooks.metrics()
    for name, grad in grads_of(twin).items():
        assert torch.equal(grads_of(model)[name], grad), name


def test_attached_context_manager_removes_on_exit_and_on_error() -> None:
    model = TinyGPT(mtp_num_layers=1).build(seed=2)
    batch = make_batch(VOCAB, seq=8)
    dicts = hook_dicts(model)
    with mtp_hooks.attached(model, loss_impl="dense") as hooks:
        assert mtp_hooks.hooks_of(model) is hooks
        assert hook_dicts(model) != dicts
        logits = model(*batch.model_args, labels=batch.labels)
        assert logits.shape == (2, 8, VOCAB)
    assert mtp_hooks.hooks_of(model) is None and hook_dicts(model) == dicts

    with pytest.raises(RuntimeError, match="inside the block"):
        with mtp_hooks.attached(model):
            raise RuntimeError("inside the block")
    assert mtp_hooks.hooks_of(model) is None and hook_dicts(model) == dicts

    with mtp_hooks.attach(model) as hooks:  # the handle is a context manager too
        assert mtp_hooks.hooks_of(model) is hooks
    assert mtp_hooks.hooks_of(model) is None and hook_dicts(model) == dicts


class LanguageModelHolder(nn.Module):
    """A multimodal-style model exposing its GPTModel as ``.language_model``."""

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.language_model = language_model

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.language_model(*args, **kwargs)


class ModuleHolder(nn.Module):
    """A DDP-style wrapper exposing the model as ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.module(*args, **kwargs)


WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "module": ModuleHolder,
    "language_model": LanguageModelHolder,
    "module_of_language_model": lambda m: ModuleHolder(LanguageModelHolder(m)),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_attach_through_wrappers_trains_like_stock_and_removes_cleanly(wrapper: str) -> None:
    spec = TinyGPT(mtp_num_layers=2)
    inner, stock = spec.build(seed=5), spec.build(seed=5)
    wrapped = WRAPPERS[wrapper](inner)
    batch = make_batch(VOCAB, seq=10, seed=5)
    dicts = hook_dicts(inner)

    with output_layer_calls(stock) as calls:
        masked_mean(stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch.loss_mask).backward()
    stock_losses = stock_mtp_losses()
    hooks = mtp_hooks.attach(wrapped)
    assert mtp_hooks.hooks_of(wrapped) is hooks and mtp_hooks.hooks_of(inner) is hooks
    assert hooks.model is inner
    logits = wrapped(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()

    assert torch.equal(logits, calls[-1].transpose(0, 1))
    metrics = hooks.metrics()
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses, rel=1e-5)
    for name, grad in grads_of(stock).items():
        torch.testing.assert_close(grads_of(inner)[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    with pytest.raises(mtp_hooks.MTPHooksError, match="already"):
        mtp_hooks.attach(inner)
    hooks.remove()
    assert hook_dicts(inner) == dicts and mtp_hooks.hooks_of(wrapped) is None


def test_attach_through_mcore_float16_module() -> None:
    """mcore's own bf16 wrapper (``.module``): logits equal stock's, MTP losses and gradients within bf16."""
    spec = TinyGPT(mtp_num_layers=2, params_dtype=torch.bfloat16)
    stock_inner, inner = spec.build(seed=3), spec.build(seed=3)
    stock, wrapped = Float16Module(stock_inner.config, stock_inner), Float16Module(inner.config, inner)
    config = inner.config
    batch = make_batch(VOCAB, seq=10, seed=3)
    with output_layer_calls(stock.module) as calls:
        per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    stock_losses = stock_mtp_losses()

    with mtp_hooks.attached(wrapped) as hooks:
        assert hooks.model is wrapped.module
        logits = wrapped(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
        metrics = hooks.metrics()

    assert logits.dtype == torch.float32  # Float16Module upcasts the last stage's output
    assert torch.equal(logits, calls[-1].transpose(0, 1).float())
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(stock_losses, rel=1e-2)
    stock_grads = grads_of(stock)
    for name, grad in grads_of(wrapped).items():
        assert grad is not None, name
        torch.testing.assert_close(grad.float(), stock_grads[name].float(), atol=2e-3, rtol=5e-2, msg=lambda m: f"{name}: {m}")
    assert inner.config is config and inner.mtp_process is True and mtp_hooks.hooks_of(wrapped) is None

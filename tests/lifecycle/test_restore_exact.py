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

import copy
import gc
import inspect
import pickle
import sys
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import Batch, TinyGPT, build_twins, grads_of, hooked_train_step, main_ce_from_logits, make_batch, masked_mean
from mtp_hooks.testing import output_layer_calls, stock_mtp_losses, stock_train_step
from tests.support.micro_batches import LanguageModelHolder, ModuleHolder

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


def probes_during(model: nn.Module, probe: Probe, run: Callable[[], Any]) -> list[str]:
    """Run ``run`` with the probe checking from pre-hooks on the decoder, the output layer and the
    first MTP layer. Returns the names of the probes that ran, followed by any problems found."""
    found: list[str] = []
    handles = []
    targets = [("decoder", model.decoder), ("output_layer", model.output_layer), ("mtp.layers.0", model.mtp.layers[0])]
    for where, module in targets:
        def hook(_m: nn.Module, _a: tuple[Any, ...], where: str = where) -> None:
            found.append(where)
            found.extend(probe.check(f"inside {where}"))  # user hooks see the stock model
        handles.append(module.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return found


def instance_attributes(model: nn.Module) -> dict[str, dict[str, int]]:
    """id() of every instance attribute of every submodule (replaced attributes show up)."""
    return {name: {key: id(value) for key, value in vars(m).items()} for name, m in model.named_modules()}


def tensor_state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, Tensor)}


def assert_stock_state(model: nn.Module, config: TransformerConfig) -> None:
    """The language model holds its real config, ``mtp_process`` and embedding, and no hooks object."""
    assert model.config is config and type(model.config) is TransformerConfig
    assert model.mtp_process is True
    assert type(model.embedding) is LanguageModelEmbedding
    assert mtp_hooks.hooks_of(model) is None


def stock_train(model: nn.Module, batch: Batch) -> tuple[Tensor, list[float]]:
    """A stock training step; returns mcore's per-token loss and its tracked MTP losses."""
    with output_layer_calls(model) as calls:
        per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    assert len(calls) == 3, "stock MTP heads and main head must all run again"
    return per_token.detach(), stock_mtp_losses()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("detach", [False, True], ids=["plain", "detach_both"])
@pytest.mark.parametrize("impl", ["lean", "dense"])
def test_no_method_is_replaced_before_during_and_after_hooked_forwards(impl: str, detach: bool) -> None:
    """Also: attach adds no parameter, buffer or state-dict entry and changes no weight."""
    model = TinyGPT(mtp_num_layers=2, tied=detach).build(seed=1)
    batch = make_batch(VOCAB, seq=8)
    probe = Probe(model)
    params, state = [id(p) for p in model.parameters()], tensor_state(model)
    assert probe.check("before attach") == []
    hooks = mtp_hooks.attach(model, loss_impl=impl, detach_encoder=detach, detach_head=detach)
    assert probe.check("after attach") == []

    found = probes_during(model, probe, lambda: hooked_train_step(model, hooks, batch, "kwargs"))
    assert [p for p in found if p.startswith("inside")] == [], found
    assert {"decoder", "output_layer", "mtp.layers.0"} <= set(found), "a probe did not run"

    found = probes_during(model, probe, torch.no_grad()(lambda: model(*batch.model_args)))
    assert [p for p in found if p.startswith("inside")] == [], found
    assert set(found) == {"decoder", "output_layer"}, "a probe did not run, or the MTP block ran"

    assert probe.check("after forwards") == []
    assert [id(p) for p in model.parameters()] == params
    assert tensor_state(model).keys() == state.keys()
    assert all(torch.equal(value, state[key]) for key, value in tensor_state(model).items())
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
    """After training and inference micro-batches and ``remove()`` (twice), the model is stock mcore
    again: per-token loss out, mcore's own MTP loss and logging back, same attribute objects, and
    outputs, gradients and state bit-identical to a never-hooked twin."""
    twins = build_twins(TinyGPT(mtp_num_layers=2, tied=tied), seed=4, attach=False)
    model, never_hooked = twins.hooked, twins.stock
    batch = make_batch(VOCAB, seq=10, seed=4)
    config, attributes, dicts = model.config, instance_attributes(model), hook_dicts(model)

    hooks = twins.attach(**options)
    hooked_train_step(model, hooks, batch, "kwargs")
    with hooks.micro_batch(labels=batch.labels):
        model(*batch.model_args).sum().backward()
    model(*batch.model_args)
    hooks.remove()
    hooks.remove()  # twice is harmless

    model.zero_grad(set_to_none=True)
    assert_stock_state(model, config)
    assert instance_attributes(model) == attributes
    assert hook_dicts(model) == dicts
    assert all(not getattr(m, d) for m in model.modules() for d in HOOK_DICTS[:5]), "a forward hook is left"
    MTPLossLoggingHelper.tracker.clear()

    loss, losses = stock_train(model, batch)
    ref_loss, ref_losses = stock_train(never_hooked, batch)
    assert torch.equal(loss, ref_loss)  # a per-token loss again, not logits
    assert losses == ref_losses and len(losses) == 2  # mcore's own MTP loss and logging are back
    ours_grads, ref_grads = grads_of(model), grads_of(never_hooked)
    assert ours_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert ours_grads[name] is not None and torch.equal(ours_grads[name], ref_grads[name]), name
    state, ref_state = model.state_dict(), never_hooked.state_dict()
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        if isinstance(value, Tensor):
            assert torch.equal(state[name], value), name


def test_attach_again_after_remove_works_like_the_first_time() -> None:
    """Attach, remove, remove again, attach (another loss): equal to a twin hooked once, and to stock."""
    twins = build_twins(TinyGPT(mtp_num_layers=2), seed=6, attach=False)
    model, config = twins.hooked, twins.hooked.config
    first_time = TinyGPT(mtp_num_layers=2).build(seed=6)
    batch = make_batch(VOCAB, seq=8, seed=6)
    hooks = twins.attach()
    hooks.remove()
    hooks.remove()
    assert_stock_state(model, config)
    again, first_time_hooks = twins.attach(loss_impl="dense"), mtp_hooks.attach(first_time, loss_impl="dense")
    assert mtp_hooks.hooks_of(model) is again
    hooked_train_step(first_time, first_time_hooks, batch, "kwargs")
    step = twins.assert_step_matches(batch, "kwargs")
    assert step.metrics == first_time_hooks.metrics()
    for name, grad in grads_of(first_time).items():
        assert torch.equal(grads_of(model)[name], grad), name


def test_attached_context_manager_removes_on_exit_and_on_error() -> None:
    twins = build_twins(TinyGPT(mtp_num_layers=1), seed=2, attach=False)
    model, config = twins.hooked, twins.hooked.config
    batch = make_batch(VOCAB, seq=8)
    dicts = hook_dicts(model)
    with mtp_hooks.attached(model, loss_impl="dense", chunk_size=4) as hooks:
        twins.hooks = hooks
        assert mtp_hooks.hooks_of(model) is hooks
        assert (hooks.options.loss_impl, hooks.options.chunk_size) == ("dense", 4)
        assert hook_dicts(model) != dicts
        assert twins.assert_step_matches(batch, "kwargs").logits.shape == (2, 8, VOCAB)
    assert hook_dicts(model) == dicts
    assert_stock_state(model, config)

    with pytest.raises(RuntimeError, match="inside the block"):
        with mtp_hooks.attached(model):
            raise RuntimeError("inside the block")
    assert hook_dicts(model) == dicts
    assert_stock_state(model, config)

    with mtp_hooks.attach(model) as hooks:  # the handle is a context manager too
        assert mtp_hooks.hooks_of(model) is hooks
    assert hook_dicts(model) == dicts
    assert_stock_state(model, config)


def test_hooks_do_not_keep_the_model_alive() -> None:
    model = TinyGPT(mtp_num_layers=1).build(seed=2)
    hooks = mtp_hooks.attach(model)
    assert hooks.model is model
    del model
    gc.collect()
    with pytest.raises(mtp_hooks.MTPHooksStateError, match="no longer exists"):
        hooks.model
    hooks.remove()


def test_user_hooks_inside_a_forward_see_the_real_config() -> None:
    model = TinyGPT(mtp_num_layers=2).build(seed=2)
    config = model.config
    seen: dict[str, Any] = {}

    def probe(module: nn.Module, args: Any) -> None:
        view = model.config
        seen.update(
            is_real=view is config,
            isinstance=isinstance(view, TransformerConfig),
            mtp_num_layers=view.mtp_num_layers,
            hidden_size=view.hidden_size,
            factor=view.mtp_loss_scaling_factor,
            submodules_real=all(m.config is config for m in (model.decoder, model.mtp, model.mtp.layers[0])),
        )
        view.probe_marker = "written through"  # writes reach the real config
        for copier in (copy.deepcopy, pickle.dumps):
            try:
                copier(view)
            except TypeError:
                seen.setdefault("uncopyable", []).append(copier.__name__)

    model.decoder.register_forward_pre_hook(probe)
    hooks = mtp_hooks.attach(model)
    try:
        hooked_train_step(model, hooks, make_batch(VOCAB))
        assert seen == {
            "is_real": True,
            "isinstance": True,
            "mtp_num_layers": 2,
            "hidden_size": config.hidden_size,
            "factor": config.mtp_loss_scaling_factor,
            "submodules_real": True,
        }
        assert config.probe_marker == "written through"
        assert model.config is config and config.mtp_num_layers == 2
    finally:
        del config.probe_marker


WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "module": ModuleHolder,
    "module_of_module": lambda m: ModuleHolder(ModuleHolder(m)),
    "language_model": LanguageModelHolder,
    "module_of_language_model": lambda m: ModuleHolder(LanguageModelHolder(m)),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_attach_through_wrappers_trains_like_stock_and_removes_cleanly(wrapper: str) -> None:
    twins = build_twins(TinyGPT(mtp_num_layers=2), seed=5, wrap=WRAPPERS[wrapper], attach=False)
    inner, wrapped = twins.hooked, twins.called
    dicts = hook_dicts(inner)
    hooks = twins.attach()
    assert mtp_hooks.hooks_of(wrapped) is hooks and mtp_hooks.hooks_of(inner) is hooks
    assert hooks.model is inner
    twins.assert_step_matches(make_batch(VOCAB, seq=10, seed=5), "kwargs")
    with pytest.raises(mtp_hooks.MTPHooksError, match="already"):
        mtp_hooks.attach(inner)
    hooks.remove()
    assert hook_dicts(inner) == dicts and mtp_hooks.hooks_of(wrapped) is None


def test_attach_through_mcore_float16_module() -> None:
    """mcore's own bf16 wrapper (``.module``): logits equal stock's, MTP losses and gradients within bf16."""
    spec = TinyGPT(mtp_num_layers=2, params_dtype=torch.bfloat16)
    wrap = lambda m: Float16Module(m.config, m)  # noqa: E731
    twins = build_twins(spec, seed=3, wrap=wrap, attach=False)
    stock, wrapped, config = wrap(twins.stock), twins.called, twins.hooked.config
    batch = make_batch(VOCAB, seq=10, seed=3)
    expected = stock_train_step(stock, batch)

    with mtp_hooks.attached(wrapped) as hooks:
        assert hooks.model is wrapped.module
        logits = wrapped(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
        metrics = hooks.metrics()

    assert logits.dtype == torch.float32  # Float16Module upcasts the last stage's output
    assert torch.equal(logits, expected.logits.float())
    assert [metrics["mtp_1/loss"], metrics["mtp_2/loss"]] == pytest.approx(expected.mtp_losses, rel=1e-2)
    stock_grads = grads_of(stock)
    for name, grad in grads_of(wrapped).items():
        assert grad is not None, name
        torch.testing.assert_close(grad.float(), stock_grads[name].float(), atol=2e-3, rtol=5e-2, msg=lambda m: f"{name}: {m}")
    assert twins.hooked.config is config and twins.hooked.mtp_process is True and mtp_hooks.hooks_of(wrapped) is None

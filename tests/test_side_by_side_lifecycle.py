"""Attach, remove, failures and bad input, each checked against an untouched stock twin.

The library's promise: hooks and proxies only, no method replaced, and after ``remove()`` (or a
forward that raised, or an input rejected) the model behaves exactly as stock mcore.
"""

from __future__ import annotations

import copy
import gc
import pickle
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import (
    MTPLossLoggingHelper,
    MultiTokenPredictionBlock,
    MultiTokenPredictionLayer,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks import MTPHooksError
from tests.mcore_cpu import (
    Batch,
    TinyGPT,
    assert_same_grads,
    hooked_train_step,
    main_ce_from_logits,
    make_batch,
    masked_mean,
    stock_mtp_losses,
    stock_train_step,
)

VOCAB = 97
CLASSES = (GPTModel, MultiTokenPredictionBlock, MultiTokenPredictionLayer, LanguageModelEmbedding, ColumnParallelLinear)


def twins(n: int = 2, **shape: Any) -> list[GPTModel]:
    spec = TinyGPT(vocab_size=VOCAB, **shape)
    return [spec.build() for _ in range(n)]


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Number of registered hooks of every kind, per submodule."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called", "_forward_hooks_with_kwargs",
             "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
    return {name: tuple(len(getattr(m, kind)) for kind in kinds) for name, m in model.named_modules()}


def instance_attributes(model: nn.Module) -> dict[str, dict[str, int]]:
    """id() of every instance attribute of every submodule (replaced attributes show up)."""
    return {name: {key: id(value) for key, value in vars(m).items()} for name, m in model.named_modules()}


def class_attributes() -> dict[str, dict[str, int]]:
    return {cls.__name__: {key: id(value) for key, value in vars(cls).items()} for cls in CLASSES}


def assert_trains_like_stock(hooked: GPTModel, hooks: mtp_hooks.MTPHooks, seed: int = 5) -> None:
    """One more training micro-batch on ``hooked`` gives the gradients of a fresh stock twin."""
    stock = TinyGPT(vocab_size=VOCAB).build()
    batch = make_batch(VOCAB, seed=seed)
    hooked.zero_grad(set_to_none=True)
    stock_train_step(stock, batch)
    hooked_train_step(hooked, hooks, batch)
    assert_same_grads(hooked, stock)


def assert_stock_state(model: GPTModel, config: TransformerConfig) -> None:
    assert model.config is config and type(model.config) is TransformerConfig
    assert model.mtp_process is True
    assert type(model.embedding) is LanguageModelEmbedding


# ------------------------------------------------------------------------ attach and remove


def test_remove_restores_stock_mcore_bit_for_bit() -> None:
    stock, hooked = twins()
    before_hooks, before_attrs = hook_counts(hooked), instance_attributes(hooked)
    config = hooked.config
    hooks = mtp_hooks.attach(hooked, detach_encoder=True, detach_head=True)
    hooked_train_step(hooked, hooks, make_batch(VOCAB, seed=1))
    hooked(*make_batch(VOCAB, seed=2).model_args)  # an inference micro-batch too
    hooks.remove()

    assert hook_counts(hooked) == before_hooks
    assert instance_attributes(hooked) == before_attrs
    assert_stock_state(hooked, config)
    assert mtp_hooks.hooks_of(hooked) is None

    hooked.zero_grad(set_to_none=True)
    batch = make_batch(VOCAB, seed=3)
    stock_mtp_losses()  # empty the tracker the hooked micro-batch wrote
    stock_loss = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    stock_losses = stock_mtp_losses()
    loss = hooked(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    assert torch.equal(loss, stock_loss)  # per-token loss again, not logits
    assert stock_mtp_losses() == stock_losses  # mcore's own MTP loss and logging are back
    masked_mean(stock_loss, batch.loss_mask).backward()
    masked_mean(loss, batch.loss_mask).backward()
    assert_same_grads(hooked, stock, atol=0, rtol=0)


def test_attach_replaces_no_method_and_adds_no_state() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    classes, attrs = class_attributes(), instance_attributes(model)
    keys = list(model.state_dict())
    state = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    params = [id(p) for p in model.parameters()]

    seen_in_forward: list[dict[str, dict[str, int]]] = []
    probe = model.output_layer.register_forward_pre_hook(lambda *_: seen_in_forward.append(instance_attributes(model)))
    hooks = mtp_hooks.attach(model, detach_encoder=True)
    hooked_train_step(model, hooks, make_batch(VOCAB))
    probe.remove()

    assert class_attributes() == classes
    for during in seen_in_forward:
        for name, values in during.items():
            assert "forward" not in values, name
            changed = {k for k in values if values[k] != attrs[name].get(k)}
            # during a forward only the language model's config (and, for inference, mtp_process) are swapped
            assert changed <= ({"config", "_mtp_hooks", "mtp_process"} if name == "" else set()), (name, changed)
    after = instance_attributes(model)
    assert {k for k in after[""] if after[""][k] != attrs[""].get(k)} == {"_mtp_hooks"}
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == keys
    for key, value in state.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_remove_twice_then_attach_again() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    hooks = mtp_hooks.attach(model)
    hooks.remove()
    hooks.remove()
    assert_stock_state(model, config)
    again = mtp_hooks.attach(model, loss_impl="dense")
    assert mtp_hooks.hooks_of(model) is again
    assert_trains_like_stock(model, again)


def test_handle_and_attached_are_context_managers() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    with mtp_hooks.attach(model) as hooks:
        assert mtp_hooks.hooks_of(model) is hooks
        assert_trains_like_stock(model, hooks)
    assert mtp_hooks.hooks_of(model) is None
    assert_stock_state(model, config)

    with pytest.raises(RuntimeError, match="inside the block"):
        with mtp_hooks.attached(model, loss_impl="dense", chunk_size=4) as hooks:
            assert (hooks.loss_impl, hooks.chunk_size) == ("dense", 4)
            raise RuntimeError("inside the block")
    assert mtp_hooks.hooks_of(model) is None
    assert_stock_state(model, config)


def test_hooks_do_not_keep_the_model_alive() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model)
    assert hooks.model is model
    del model
    gc.collect()
    with pytest.raises(MTPHooksError, match="no longer exists"):
        hooks.model
    hooks.remove()


# ------------------------------------------------------------------------------ config view


def test_model_config_reads_no_mtp_layers_only_during_forward() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
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
            "is_real": False,
            "isinstance": True,
            "mtp_num_layers": None,
            "hidden_size": config.hidden_size,
            "factor": config.mtp_loss_scaling_factor,
            "submodules_real": True,
            "uncopyable": ["deepcopy", "dumps"],
        }
        assert config.probe_marker == "written through"
        assert model.config is config and config.mtp_num_layers == 2
    finally:
        del config.probe_marker


# ------------------------------------------------------------------------- failing forwards


def raise_boom(*_: Any) -> None:
    raise RuntimeError("boom")


WHERE = {
    "decoder": lambda m: m.decoder,
    "mtp_layer_1": lambda m: m.mtp.layers[1],
    "output_layer": lambda m: m.output_layer,
}


@pytest.mark.parametrize(
    "where, train",
    [(where, True) for where in WHERE] + [(where, False) for where in WHERE if not where.startswith("mtp")],
    ids=lambda value: {True: "training", False: "inference"}.get(value, value) if isinstance(value, bool) else value,
)
def test_a_forward_that_raises_restores_everything(where: str, train: bool) -> None:
    """Inference forwards do not run the MTP layers, so they are only made to fail elsewhere."""
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    hooks = mtp_hooks.attach(model)
    handle = WHERE[where](model).register_forward_pre_hook(raise_boom)
    batch = make_batch(VOCAB)
    with pytest.raises(RuntimeError, match="boom"):
        if train:
            with hooks.micro_batch(batch.labels, batch.loss_mask):
                model(*batch.model_args)
        else:
            model(*batch.model_args)
    handle.remove()

    assert_stock_state(model, config)
    assert mtp_hooks.hooks_of(model) is hooks
    assert hooks.metrics() == {}  # nothing half-recorded
    assert_trains_like_stock(model, hooks)


def test_a_forward_that_raises_after_the_mtp_losses_records_no_metrics() -> None:
    """The MTP losses are computed in the output layer's pre-hook; if the main head then raises, the
    micro-batch never reaches backward and must not count in ``metrics()``."""
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model)
    model.output_layer.register_forward_pre_hook(raise_boom)  # runs after the library's pre-hook
    batch = make_batch(VOCAB)
    with pytest.raises(RuntimeError, match="boom"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    assert hooks.metrics() == {}


@pytest.mark.parametrize("detach_head", [False, True])
def test_a_forward_that_raises_with_detach_options_restores_everything(detach_head: bool) -> None:
    stock, model = twins()
    config = model.config
    hooks = mtp_hooks.attach(model, detach_encoder=True, detach_head=detach_head)
    handle = model.mtp.layers[1].register_forward_pre_hook(raise_boom)
    batch = make_batch(VOCAB)
    with pytest.raises(RuntimeError, match="boom"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    handle.remove()
    assert_stock_state(model, config)
    hooks.remove()
    stock_train_step(stock, batch)
    stock_train_step(model, batch)
    assert_same_grads(model, stock, atol=0, rtol=0)


def test_failed_forward_inside_micro_batch_drops_its_targets() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model)
    handle = model.decoder.register_forward_pre_hook(raise_boom)
    batch = make_batch(VOCAB)
    with pytest.raises(RuntimeError, match="boom"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    handle.remove()
    mtp_calls = []
    model.mtp.register_forward_pre_hook(lambda *_: mtp_calls.append(1))
    model(*batch.model_args)  # no stale labels: an inference micro-batch
    assert mtp_calls == []


def test_nested_forward_of_the_same_model_is_refused() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB)
    inner_errors: list[BaseException] = []

    def reenter(*_: Any) -> None:
        try:
            model(*batch.model_args)
        except MTPHooksError as error:
            inner_errors.append(error)
            raise

    handle = model.decoder.register_forward_pre_hook(reenter)
    with pytest.raises(MTPHooksError, match="nested"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    handle.remove()
    assert len(inner_errors) == 1
    assert_stock_state(model, config)
    assert_trains_like_stock(model, hooks)


# ----------------------------------------------------------------------------------- wrappers


class DDPLike(nn.Module):
    """Exposes the wrapped model as ``.module`` and forwards calls, like DDP and Float16Module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class WithLanguageModel(nn.Module):
    """A multimodal-style model whose ``.language_model`` is the GPTModel."""

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.language_model = language_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.language_model(*args, **kwargs)


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda m: DDPLike(m), id="module"),
        pytest.param(lambda m: DDPLike(DDPLike(m)), id="module-module"),
        pytest.param(lambda m: DDPLike(WithLanguageModel(m)), id="module-language_model"),
    ],
)
def test_wrapped_models_train_like_stock(wrap: Callable[[nn.Module], nn.Module]) -> None:
    stock, inner = twins()
    wrapper = wrap(inner)
    hooks = mtp_hooks.attach(wrapper)
    assert hooks.model is inner
    assert mtp_hooks.hooks_of(wrapper) is hooks and mtp_hooks.hooks_of(inner) is hooks
    batch = make_batch(VOCAB)
    stock_train_step(stock, batch)
    hooked_train_step(wrapper, hooks, batch)
    assert_same_grads(inner, stock)
    with pytest.raises(MTPHooksError, match="already"):
        mtp_hooks.attach(inner)


def test_hooks_of_plain_models() -> None:
    assert mtp_hooks.hooks_of(TinyGPT(vocab_size=VOCAB).build()) is None
    with pytest.raises(MTPHooksError, match="^model:"):
        mtp_hooks.hooks_of(nn.Linear(2, 2))


# ------------------------------------------------------------------------ attach: bad input


def test_errors_are_value_errors() -> None:
    assert issubclass(MTPHooksError, ValueError)


@pytest.mark.parametrize(
    "option, value",
    [
        ("detach_encoder", 1),
        ("detach_encoder", None),
        ("detach_head", "yes"),
        ("loss_scale", -0.1),
        ("loss_scale", float("nan")),
        ("loss_scale", True),
        ("loss_scale", "0.3"),
        ("loss_impl", "flash"),
        ("loss_impl", None),
        ("chunk_size", 0),
        ("chunk_size", -8),
        ("chunk_size", 2.0),
        ("chunk_size", True),
    ],
)
def test_attach_rejects_bad_options_and_leaves_the_model_stock(option: str, value: Any) -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    before = hook_counts(model)
    with pytest.raises(MTPHooksError, match=f"^{option}: bad value\n  expected: .+\n  received: .+"):
        mtp_hooks.attach(model, **{option: value})
    assert hook_counts(model) == before
    assert mtp_hooks.hooks_of(model) is None


@pytest.mark.parametrize("option, value", [("loss_scale", 0), ("loss_scale", 2), ("chunk_size", 1), ("chunk_size", 10**9)])
def test_attach_accepts_boundary_options(option: str, value: Any) -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model, **{option: value})
    hooked_train_step(model, hooks, make_batch(VOCAB))


def test_attach_rejects_a_model_without_mtp_layers() -> None:
    model = TinyGPT(vocab_size=VOCAB, mtp_num_layers=None).build()
    with pytest.raises(MTPHooksError, match="^model: bad value\n  expected: a model with MTP layers"):
        mtp_hooks.attach(model)


@pytest.mark.parametrize("thing", [nn.Linear(2, 2), DDPLike(nn.Linear(2, 2)), DDPLike(None)])
def test_attach_rejects_what_is_not_an_mcore_language_model(thing: nn.Module) -> None:
    with pytest.raises(MTPHooksError, match="^model: bad value"):
        mtp_hooks.attach(thing)


def test_attach_twice_is_refused_and_the_first_hooks_keep_working() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model)
    before = hook_counts(model)
    with pytest.raises(MTPHooksError, match="already"):
        mtp_hooks.attach(model, loss_impl="dense")
    assert hook_counts(model) == before
    assert mtp_hooks.hooks_of(model) is hooks
    assert_trains_like_stock(model, hooks)


def test_attach_needs_a_loss_scale_when_the_config_has_none() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    model.config.mtp_loss_scaling_factor = None
    with pytest.raises(MTPHooksError, match="^loss_scale: bad value"):
        mtp_hooks.attach(model)
    hooks = mtp_hooks.attach(model, loss_scale=0.3)  # the twin's configured factor
    assert_trains_like_stock(model, hooks)


def test_attach_rejects_an_output_layer_with_bias() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    model.output_layer.bias = nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(MTPHooksError, match="bias"):
        mtp_hooks.attach(model)


# -------------------------------------------------------------- micro-batches: bad input


def labels_and_mask(batch: Batch) -> tuple[Tensor, Tensor]:
    assert batch.loss_mask is not None
    return batch.labels, batch.loss_mask


BAD_TARGETS: dict[str, Callable[[Tensor, Tensor], tuple[Any, Any]]] = {
    "labels-float": lambda l, m: (l.float(), m),
    "labels-bool": lambda l, m: (l.bool(), m),
    "labels-1d": lambda l, m: (l[0], None),
    "labels-3d": lambda l, m: (l[None], None),
    "labels-list": lambda l, m: (l.tolist(), None),
    "mask-shape": lambda l, m: (l, m[:, :-1]),
    "mask-value-2": lambda l, m: (l, m * 2),
    "mask-value-half": lambda l, m: (l, m * 0.5),
    "mask-list": lambda l, m: (l, m.tolist()),
}


@pytest.mark.parametrize("case", list(BAD_TARGETS))
def test_micro_batch_rejects_bad_targets_before_any_forward(case: str) -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model)
    labels, mask = BAD_TARGETS[case](*labels_and_mask(make_batch(VOCAB)))
    name = case.split("-")[0].replace("mask", "loss_mask")
    with pytest.raises(MTPHooksError, match=f"^{name}: bad value"):
        with hooks.micro_batch(labels, mask):
            pytest.fail("the block must not run")
    assert_trains_like_stock(model, hooks)


@pytest.mark.parametrize("case", ["labels-float", "mask-shape", "mask-value-2"])
def test_labels_in_the_call_are_validated_like_micro_batch(case: str) -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB)
    labels, mask = BAD_TARGETS[case](*labels_and_mask(batch))
    with pytest.raises(MTPHooksError):
        model(*batch.model_args, labels=labels, loss_mask=mask)
    assert_stock_state(model, config)
    assert_trains_like_stock(model, hooks)


def test_labels_must_match_input_ids() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    hooks = mtp_hooks.attach(model)
    batch, other = make_batch(VOCAB, seq=8), make_batch(VOCAB, seq=6)
    with pytest.raises(MTPHooksError, match="^labels: bad value\n  expected: shape of input_ids"):
        with hooks.micro_batch(other.labels, other.loss_mask):
            model(*batch.model_args)
    with pytest.raises(MTPHooksError, match="^labels: bad value\n  expected: shape of input_ids"):
        model(*batch.model_args, labels=other.labels)
    assert_stock_state(model, config)
    assert_trains_like_stock(model, hooks)


def test_one_forward_per_micro_batch() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)
        with pytest.raises(MTPHooksError, match="^micro_batch: bad value"):
            model(*batch.model_args)
        assert_stock_state(model, config)
    # the first forward's graph is intact: its backward still matches stock
    stock = TinyGPT(vocab_size=VOCAB).build()
    stock_train_step(stock, batch)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_grads(model, stock)


def test_nested_micro_batch_is_refused_and_the_outer_one_survives() -> None:
    stock, model = twins()
    hooks = mtp_hooks.attach(model)
    batch, other = make_batch(VOCAB, seed=0), make_batch(VOCAB, seed=1)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        with pytest.raises(MTPHooksError, match="^micro_batch: bad value"):
            with hooks.micro_batch(other.labels, other.loss_mask):
                pytest.fail("the block must not run")
        logits = model(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    stock_train_step(stock, batch)
    assert_same_grads(model, stock)


def test_labels_cannot_come_both_ways() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    config = model.config
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        with pytest.raises(MTPHooksError, match="^labels: bad value"):
            model(*batch.model_args, labels=batch.labels)
    assert_stock_state(model, config)
    with pytest.raises(MTPHooksError, match="^labels: bad value"):
        model(*batch.model_args, loss_mask=batch.loss_mask)  # a mask without labels
    assert_stock_state(model, config)
    assert_trains_like_stock(model, hooks)


def test_micro_batch_closed_without_a_forward_leaves_no_targets() -> None:
    model = TinyGPT(vocab_size=VOCAB).build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        pass
    model(*batch.model_args)
    assert hooks.metrics() == {}
    assert MTPLossLoggingHelper.tracker == {}

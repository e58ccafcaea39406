"""Every bad input raises ``MTPHooksError`` naming the argument, with what was expected and received;
a refused input or a forward that raises leaves no state behind: the next calls are clean micro-batches.

"Clean" is checked against a stock twin: an inference call returns stock's main logits without
running the MTP block, and a training call gives stock's logits, MTP losses and every gradient
(``tests.support.micro_batches.assert_next_micro_batches_like_stock``).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import mtp_hooks
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import Batch, TinyGPT, build_twins, hooked_train_step, make_batch, stock_train_step
from tests.support.micro_batches import ModuleHolder, assert_next_micro_batches_like_stock, mtp_block_calls

VOCAB = 64
SEQ = 8
SEED = 3
SHAPE = TinyGPT(vocab_size=VOCAB, mtp_num_layers=2)


def names(argument: str) -> str:
    """Pattern for a message that names ``argument``, then what was expected and what was received."""
    return rf"(?s)^{re.escape(argument)}: bad value\n  expected: \S.*\n  received: \S"


def hook_state(model: nn.Module) -> list[Any]:
    """Hooks of every kind per submodule, and the model's attribute names."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called", "_forward_hooks_with_kwargs",
             "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
    return [(name, *(len(getattr(m, kind)) for kind in kinds)) for name, m in model.named_modules()] + [sorted(vars(model))]


def assert_stock_state(model: nn.Module, config: TransformerConfig) -> None:
    """The language model holds its real config, ``mtp_process`` and embedding again."""
    assert model.config is config and type(model.config) is TransformerConfig
    assert model.mtp_process is True
    assert type(model.embedding) is LanguageModelEmbedding


def assert_clean_next_calls(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """After an error: the model is stock with hooks, and the next micro-batches behave like stock."""
    assert type(model.config) is TransformerConfig and model.mtp_process is True
    assert mtp_hooks.hooks_of(model) is hooks
    assert_next_micro_batches_like_stock(model, hooks, SHAPE, SEED, batch)


@pytest.fixture
def model() -> nn.Module:
    return SHAPE.build(SEED)


@pytest.fixture
def batch() -> Batch:
    return make_batch(VOCAB, seq=SEQ, seed=SEED)


# --------------------------------------------------------------------------- attach


ATTACH_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "loss_scale_negative": ("loss_scale", {"loss_scale": -0.1}),
    "loss_scale_nan": ("loss_scale", {"loss_scale": float("nan")}),
    "loss_scale_string": ("loss_scale", {"loss_scale": "0.3"}),
    "loss_scale_bool": ("loss_scale", {"loss_scale": True}),
    "loss_impl_unknown": ("loss_impl", {"loss_impl": "flash"}),
    "loss_impl_none": ("loss_impl", {"loss_impl": None}),
    "chunk_size_zero": ("chunk_size", {"chunk_size": 0}),
    "chunk_size_negative": ("chunk_size", {"chunk_size": -8}),
    "chunk_size_float": ("chunk_size", {"chunk_size": 2.5}),
    "chunk_size_whole_float": ("chunk_size", {"chunk_size": 2.0}),
    "chunk_size_bool": ("chunk_size", {"chunk_size": True}),
    "detach_encoder_int": ("detach_encoder", {"detach_encoder": 1}),
    "detach_encoder_none": ("detach_encoder", {"detach_encoder": None}),
    "detach_head_string": ("detach_head", {"detach_head": "yes"}),
    "draft_step_weights_negative_decay": ("draft_step_weights", {"draft_step_weights": -0.5}),
    "draft_step_weights_nan": ("draft_step_weights", {"draft_step_weights": float("nan")}),
    "draft_step_weights_all_zero": ("draft_step_weights", {"draft_step_weights": (0.0, 0.0)}),
    "draft_step_weights_negative_weight": ("draft_step_weights", {"draft_step_weights": (1.0, -1.0)}),
    "draft_step_weights_too_many": ("draft_step_weights", {"draft_step_weights": (1.0, 0.5, 0.25)}),
    "draft_step_weights_too_few_for_the_chain": ("draft_step_weights", {"draft_step_weights": (1.0, 0.5), "draft_steps": 3}),
    "draft_step_weights_empty": ("draft_step_weights", {"draft_step_weights": ()}),
    "draft_step_weights_string": ("draft_step_weights", {"draft_step_weights": "0.6"}),
    "draft_step_weights_bool": ("draft_step_weights", {"draft_step_weights": True}),
}


@pytest.mark.parametrize("case", list(ATTACH_CASES))
def test_attach_rejects_bad_options_and_touches_nothing(model: nn.Module, case: str) -> None:
    argument, options = ATTACH_CASES[case]
    before = hook_state(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names(argument)):
        mtp_hooks.attach(model, **options)
    assert hook_state(model) == before
    assert mtp_hooks.hooks_of(model) is None
    mtp_hooks.attach(model).remove()  # nothing half-attached is left in the way


@pytest.mark.parametrize("option, value", [("loss_scale", 0), ("loss_scale", 2), ("chunk_size", 1), ("chunk_size", 10**9),
                                           ("draft_step_weights", (0, 1)), ("draft_step_weights", 1e-3)])
def test_attach_accepts_boundary_options(model: nn.Module, batch: Batch, option: str, value: Any) -> None:
    hooks = mtp_hooks.attach(model, **{option: value})
    hooked_train_step(model, hooks, batch)


def test_attach_rejects_a_model_without_mtp_layers() -> None:
    model = TinyGPT(mtp_num_layers=None).build(seed=1)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("model")) as error:
        mtp_hooks.attach(model)
    assert re.search("^model: bad value\n  expected: a model with MTP layers", str(error.value))
    assert "mtp_num_layers" in str(error.value)
    assert mtp_hooks.hooks_of(model) is None


@pytest.mark.parametrize("thing", [nn.Linear(2, 2), ModuleHolder(nn.Linear(2, 2)), ModuleHolder(None)], ids=["linear", "module-linear", "module-none"])
def test_attach_rejects_what_is_not_an_mcore_language_model(thing: nn.Module) -> None:
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("model")):
        mtp_hooks.attach(thing)


def test_attach_twice_is_refused_naming_model_and_the_first_hooks_keep_working(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    before = hook_state(model)
    for options in ({}, {"loss_impl": "dense"}):
        with pytest.raises(mtp_hooks.MTPHooksError, match=names("model")) as error:
            mtp_hooks.attach(model, **options)
        assert "already" in str(error.value)
    assert hook_state(model) == before
    assert mtp_hooks.hooks_of(model) is hooks
    assert_clean_next_calls(model, hooks, batch)


def test_attach_needs_a_loss_scale_when_the_config_has_none(model: nn.Module, batch: Batch) -> None:
    model.config.mtp_loss_scaling_factor = None
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("loss_scale")):
        mtp_hooks.attach(model)
    hooks = mtp_hooks.attach(model, loss_scale=SHAPE.config().mtp_loss_scaling_factor)  # the twin's configured factor
    assert_clean_next_calls(model, hooks, batch)


def test_attach_rejects_an_output_layer_with_bias(model: nn.Module) -> None:
    model.output_layer.bias = nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(mtp_hooks.MTPHooksError, match="bias"):
        mtp_hooks.attach(model)


def test_hooks_of_plain_models(model: nn.Module) -> None:
    assert mtp_hooks.hooks_of(model) is None
    assert mtp_hooks.hooks_of(nn.Linear(2, 2)) is None


def test_errors_are_value_errors() -> None:
    assert issubclass(mtp_hooks.MTPHooksError, ValueError)


# --------------------------------------------------------------------------- targets


TARGET_CASES: dict[str, tuple[str, Callable[[Batch], tuple[Any, Any]]]] = {
    "labels_1d": ("labels", lambda b: (b.labels[0], None)),
    "labels_3d": ("labels", lambda b: (b.labels[None], None)),
    "labels_float": ("labels", lambda b: (b.labels.float(), b.loss_mask)),
    "labels_bool": ("labels", lambda b: (b.labels > 3, b.loss_mask)),
    "labels_list": ("labels", lambda b: (b.labels.tolist(), None)),
    "loss_mask_twos": ("loss_mask", lambda b: (b.labels, b.loss_mask * 2)),
    "loss_mask_fraction": ("loss_mask", lambda b: (b.labels, b.loss_mask * 0.5)),
    "loss_mask_negative": ("loss_mask", lambda b: (b.labels, -b.loss_mask)),
    "loss_mask_shape": ("loss_mask", lambda b: (b.labels, b.loss_mask[:, :-1])),
    "loss_mask_transposed": ("loss_mask", lambda b: (b.labels, b.loss_mask.t())),
    "loss_mask_list": ("loss_mask", lambda b: (b.labels, b.loss_mask.tolist())),
}


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_micro_batch_rejects_bad_targets(model: nn.Module, batch: Batch, case: str) -> None:
    argument, make = TARGET_CASES[case]
    labels, loss_mask = make(batch)
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names(argument)):
        with hooks.micro_batch(labels=labels, loss_mask=loss_mask):
            pytest.fail("the body must not run")
    assert_clean_next_calls(model, hooks, batch)


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_model_call_rejects_bad_targets_and_stays_clean(model: nn.Module, batch: Batch, case: str) -> None:
    argument, make = TARGET_CASES[case]
    labels, loss_mask = make(batch)
    config = model.config
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names(argument)):
        model(*batch.model_args, labels=labels, loss_mask=loss_mask)
    assert_stock_state(model, config)
    assert_clean_next_calls(model, hooks, batch)


@pytest.mark.parametrize("path", ["context", "kwargs"])
@pytest.mark.parametrize("shape", [(2, SEQ - 1), (1, SEQ), (2, SEQ + 3)])
def test_labels_not_shaped_like_input_ids_are_rejected(model: nn.Module, batch: Batch, path: str, shape: tuple[int, int]) -> None:
    labels = torch.zeros(shape, dtype=torch.long)
    config = model.config
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("labels")) as error:
        if path == "context":
            with hooks.micro_batch(labels=labels):
                model(*batch.model_args)
        else:
            model(*batch.model_args, labels=labels)
    assert "expected: shape of input_ids" in str(error.value)
    assert str(tuple(batch.input_ids.shape)) in str(error.value) and str(shape) in str(error.value)
    assert_stock_state(model, config)
    assert_clean_next_calls(model, hooks, batch)


def test_loss_mask_without_labels_is_rejected(model: nn.Module, batch: Batch) -> None:
    config = model.config
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=names("labels")):
        model(*batch.model_args, loss_mask=batch.loss_mask)
    assert_stock_state(model, config)
    assert_clean_next_calls(model, hooks, batch)


def test_micro_batch_closed_without_a_forward_leaves_no_targets(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        pass
    with mtp_block_calls(model) as calls:
        model(*batch.model_args)
    assert calls == []
    assert hooks.metrics() == {}
    assert MTPLossLoggingHelper.tracker == {}


# --------------------------------------------------------------------------- forwards that raise


class Boom(RuntimeError):
    pass


def raise_from(module: nn.Module) -> Any:
    def hook(_m: nn.Module, _a: tuple[Any, ...]) -> None:
        raise Boom("raised inside the forward")

    return module.register_forward_pre_hook(hook)


FAILURE_POINTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "decoder": lambda m: m.decoder,
    "first_mtp_layer": lambda m: m.mtp.layers[0],
    "last_mtp_layer": lambda m: m.mtp.layers[-1],
    "mtp_embedding": lambda m: m.embedding.word_embeddings,
    "output_layer": lambda m: m.output_layer,
}


# Inference forwards never run the MTP layers, so they can only fail in the trunk, the embedding or the head.
FAILURE_CASES = [
    pytest.param(where, path, id=f"{where}-{path}")
    for where in FAILURE_POINTS
    for path in ("context", "kwargs", "inference")
    if path != "inference" or "mtp_layer" not in where
]


@pytest.mark.parametrize("detach", [False, True], ids=["plain", "detach_both"])
@pytest.mark.parametrize("where,path", FAILURE_CASES)
def test_a_forward_that_raises_leaves_no_stale_state(model: nn.Module, batch: Batch, where: str, path: str, detach: bool) -> None:
    hooks = mtp_hooks.attach(model, detach_encoder=detach, detach_head=detach)
    config = model.config
    handle = raise_from(FAILURE_POINTS[where](model))
    with pytest.raises(Boom):
        if path == "context":
            with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
                model(*batch.model_args)
        elif path == "kwargs":
            model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        else:
            model(*batch.model_args)
    handle.remove()
    assert_stock_state(model, config)
    assert hooks.metrics() == {}  # nothing half-recorded
    assert_clean_next_calls(model, hooks, batch)


@pytest.mark.parametrize("detach_head", [False, True])
def test_a_forward_that_raises_with_detach_options_restores_everything(batch: Batch, detach_head: bool) -> None:
    """After the fault and ``remove()``, the model trains bit for bit like a never-hooked twin."""
    twins = build_twins(SHAPE, SEED, detach_encoder=True, detach_head=detach_head)
    model, hooks = twins.hooked, twins.hooks
    assert hooks is not None
    config = model.config
    handle = raise_from(model.mtp.layers[1])
    with pytest.raises(Boom):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    handle.remove()
    assert_stock_state(model, config)
    hooks.remove()
    twins.stock_step(batch)
    stock_train_step(model, batch)
    twins.assert_same_grads(atol=0, rtol=0)


@pytest.mark.parametrize("hook_kind", ["forward_hook", "pre_hook_after_attach"])
def test_a_forward_that_raises_after_the_mtp_losses_leaves_no_metrics(model: nn.Module, batch: Batch, hook_kind: str) -> None:
    """The output layer raises after the hooks computed the MTP losses (its own pre-hook runs before a
    pre-hook registered after attach): that micro-batch never happened for the user, so it must not
    show up in ``metrics()``."""
    hooks = mtp_hooks.attach(model)

    def explode(*_: Any) -> None:
        raise Boom("raised after the MTP losses")

    if hook_kind == "forward_hook":
        handle = model.output_layer.register_forward_hook(explode)
    else:
        handle = model.output_layer.register_forward_pre_hook(explode)
    with pytest.raises(Boom):
        model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    handle.remove()
    assert hooks.metrics() == {}
    assert_clean_next_calls(model, hooks, batch)


def test_input_that_makes_mcore_raise_leaves_no_stale_state(model: nn.Module, batch: Batch) -> None:
    hooks = mtp_hooks.attach(model)
    bad_ids = batch.input_ids.clone()
    bad_ids[0, 0] = VOCAB + 100  # out of the embedding table
    with pytest.raises((IndexError, RuntimeError)):
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            model(bad_ids, batch.position_ids, None)
    assert_clean_next_calls(model, hooks, batch)


def test_nested_forward_of_the_same_model_is_refused(model: nn.Module, batch: Batch) -> None:
    config = model.config
    hooks = mtp_hooks.attach(model)
    inner_errors: list[BaseException] = []

    def reenter(*_: Any) -> None:
        try:
            model(*batch.model_args)
        except mtp_hooks.MTPHooksStateError as error:
            inner_errors.append(error)
            raise

    handle = model.decoder.register_forward_pre_hook(reenter)
    with pytest.raises(mtp_hooks.MTPHooksStateError, match="nested"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    handle.remove()
    assert len(inner_errors) == 1
    assert_stock_state(model, config)
    assert_clean_next_calls(model, hooks, batch)

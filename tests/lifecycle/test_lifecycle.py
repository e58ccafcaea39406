"""The model is stock whenever none of the hooks' forwards is running, and every user hook sees it.

A forward changes the language model only inside a short window of mcore's own post-processing
(``mtp_hooks/runtime/forward.py``), which no user hook on the model's modules sees. Pinned here: the config
view inside that window is a config of the config's own class; interrupts leave a stock model;
targets live only in their ``with`` block (grad-disabled forwards never use them up, a recompute
of the same forward repeats them); only forwards that really complete are counted; user calls
of the output layer work as in stock; offloading marks and call conventions; API edges.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import mtp_hooks
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import TinyGPT, assert_same_grads, assert_same_mtp_losses, hooked_train_step, main_ce_from_logits, make_batch
from mtp_hooks.testing import masked_mean, stock_mtp_losses, stock_train_step, tracked_mtp_losses
from tests.support.mcore_cpu import mtp_inner_layer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)


def config_behaviour(config: Any) -> dict[str, Any]:
    """What user code may do with a config, as results comparable with the real config's."""

    def attempt(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - the outcome is compared
            return f"raised {type(error).__name__}"

    return {
        "isinstance": isinstance(config, TransformerConfig),
        "is_dataclass": dataclasses.is_dataclass(config),
        "replace": attempt(lambda: (type(dataclasses.replace(config)), dataclasses.replace(config).hidden_size)),
        "asdict": attempt(lambda: len(dataclasses.asdict(config))),
        "copy": attempt(lambda: (type(copy.copy(config)), copy.copy(config).mtp_num_layers)),
        "deepcopy": attempt(lambda: (type(copy.deepcopy(config)), copy.deepcopy(config).mtp_num_layers)),
        "pickle": attempt(lambda: type(pickle.loads(pickle.dumps(config)))),
    }


# Sites where user hooks run inside a training forward.
USER_SITES: dict[str, Callable[[GPTModel], tuple[nn.Module, bool]]] = {
    "decoder_pre": lambda m: (m.decoder, True),
    "decoder_post": lambda m: (m.decoder, False),
    "mtp_layer": lambda m: (mtp_inner_layer(m.mtp.layers[1]), False),
    "mtp_block_post": lambda m: (m.mtp, False),
    "output_layer_pre": lambda m: (m.output_layer, True),
    "output_layer_post": lambda m: (m.output_layer, False),
    "model_post": lambda m: (m, False),
}


@pytest.mark.parametrize("site", list(USER_SITES))
def test_user_hooks_inside_a_forward_see_the_stock_model(site: str) -> None:
    model = SHAPE.build(7)
    config = model.config
    reference = config_behaviour(config)
    seen: list[Any] = []

    def probe(*_: Any) -> None:
        seen.append((model.config is config, model.mtp_process, config_behaviour(model.config)))

    module, pre = USER_SITES[site](model)
    hooks = mtp_hooks.attach(model)
    handle = module.register_forward_pre_hook(probe) if pre else module.register_forward_hook(probe)
    hooked_train_step(model, hooks, make_batch(VOCAB, seed=1))
    with torch.no_grad():
        model(*make_batch(VOCAB, seed=2).model_args)
    handle.remove()
    assert seen and all(s == (True, True, reference) for s in seen), seen[0]


def test_config_view_inside_the_window_is_a_config_of_its_own_class() -> None:
    """A global hook on the output layer runs inside the window: there ``model.config`` is the view."""
    model = SHAPE.build(7)
    config = model.config
    reference = config_behaviour(config)
    seen: list[Any] = []

    def probe(module: nn.Module, _args: Any) -> None:
        if module is model.output_layer and model.__dict__["config"] is not config:
            view = model.config
            seen.append((view.mtp_num_layers, view.hidden_size, config_behaviour(view)))
            view.probe_marker = "written through"

    hooks = mtp_hooks.attach(model)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(probe)
    try:
        hooked_train_step(model, hooks, make_batch(VOCAB, seed=1))
        with torch.no_grad():
            model(*make_batch(VOCAB, seed=2).model_args)
    finally:
        handle.remove()
    assert len(seen) == 2, "the window never opened"
    replaced = (TransformerConfig, config.hidden_size)
    for mtp_num_layers, hidden_size, behaviour in seen:
        assert (mtp_num_layers, hidden_size) == (None, config.hidden_size)  # what stock's loss gate reads
        assert behaviour == {**reference, "replace": replaced}, behaviour
    assert config.probe_marker == "written through" and model.config is config and config.mtp_num_layers == 2
    del config.probe_marker


INTERRUPTS = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit, "CancelledError": asyncio.CancelledError}


@pytest.mark.parametrize("interrupt", list(INTERRUPTS))
@pytest.mark.parametrize("site", list(USER_SITES))
def test_an_interrupt_in_any_user_hook_leaves_a_stock_model_at_once(site: str, interrupt: str) -> None:
    model = SHAPE.build(7)
    config = model.config
    hooks = mtp_hooks.attach(model)

    def fire(*_: Any) -> None:
        raise INTERRUPTS[interrupt]()

    module, pre = USER_SITES[site](model)
    handle = module.register_forward_pre_hook(fire) if pre else module.register_forward_hook(fire)
    batch = make_batch(VOCAB, seed=1)
    try:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    except INTERRUPTS[interrupt]:
        # what a "save on Ctrl-C" handler does, before any other call into the model or hooks
        assert model.config is config and model.mtp_process is True
        assert config_behaviour(model.config) == config_behaviour(config)
    else:
        raise AssertionError("the interrupt did not propagate")
    finally:
        handle.remove()
    hooks.metrics()
    hooks.remove()
    assert mtp_hooks.hooks_of(model) is None and model.config is config


def test_an_interrupt_inside_the_window_is_undone_by_the_first_config_read() -> None:
    model = SHAPE.build(7)
    config = model.config
    mtp_hooks.attach(model)

    def fire(module: nn.Module, _args: Any) -> None:
        if module is model.output_layer and model.__dict__["config"] is not config:
            raise KeyboardInterrupt

    handle = torch.nn.modules.module.register_module_forward_pre_hook(fire)
    try:
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            model(*make_batch(VOCAB, seed=1).model_args)
    finally:
        handle.remove()
    assert model.config.mtp_num_layers == 2  # read outside the forward: stock restored by the read
    assert model.config is config and model.mtp_process is True


def test_grad_disabled_forward_inside_micro_batch_leaves_the_targets_to_the_training_forward() -> None:
    """Old-policy log-probs first, then the training forward of the same micro-batch."""
    model, stock = SHAPE.build(7), SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=1)
    stock_train_step(stock, batch)
    expected = stock_mtp_losses()
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        with torch.no_grad():
            model(*batch.model_args)  # inference: no MTP, targets untouched
        logits = model(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_mtp_losses(hooks.metrics(), expected)
    assert_same_grads(model, stock)


def test_only_forwards_that_complete_are_counted() -> None:
    """A model forward hook registered after attach raises: the failed call counts for nothing."""
    model = SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    handle = model.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("user hook failed")))
    stock_mtp_losses()  # empties mcore's tracker
    batch = make_batch(VOCAB, seed=1)
    with pytest.raises(RuntimeError, match="user hook failed"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    handle.remove()
    assert hooks.metrics() == {} and tracked_mtp_losses() is None and hooks.loss_path is None
    hooked_train_step(model, hooks, batch)
    assert hooks.metrics()["mtp_1/tokens"] == float(batch.loss_mask[:, 1:].sum())


def test_checkpointed_forward_trains_like_stock_checkpointed_forward() -> None:
    """``torch.utils.checkpoint`` recomputes the forward in backward: it sees the same targets."""
    model, stock = SHAPE.build(7), SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=1)
    stock_train_step(SHAPE.build(7), batch)
    expected = stock_mtp_losses()  # stock's tracker records the recompute too: compare with one plain step
    per_token = torch.utils.checkpoint.checkpoint(stock, *batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, use_reentrant=False)
    masked_mean(per_token, batch.loss_mask).backward()
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = torch.utils.checkpoint.checkpoint(model, *batch.model_args, use_reentrant=False)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_mtp_losses(hooks.metrics(), expected)  # counted once, not again by the recompute
    assert_same_grads(model, stock)
    with torch.no_grad():
        model(*batch.model_args)  # outside backward the same inputs are inference again
    assert hooks.metrics() == {}


def test_checkpointed_forward_with_label_kwargs_trains_like_stock() -> None:
    model, stock = SHAPE.build(7), SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=2)
    per_token = torch.utils.checkpoint.checkpoint(stock, *batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, use_reentrant=False)
    masked_mean(per_token, batch.loss_mask).backward()
    logits = torch.utils.checkpoint.checkpoint(model, *batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, use_reentrant=False)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_grads(model, stock)
    assert hooks.metrics()["mtp_1/tokens"] > 0


def test_int32_input_ids_with_int64_labels_are_accepted_as_stock() -> None:
    model, stock = SHAPE.build(7), SHAPE.build(7)
    mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=3)
    ids, positions, mask = batch.model_args
    per_token = stock(ids.int(), positions, mask, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(per_token, batch.loss_mask).backward()
    logits = model(ids.int(), positions, mask, labels=batch.labels, loss_mask=batch.loss_mask)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert_same_grads(model, stock)


def test_hooks_of_a_module_without_a_language_model_is_none() -> None:
    assert mtp_hooks.hooks_of(nn.Linear(2, 2)) is None


def test_a_logit_lens_calling_the_output_layer_inside_a_training_forward_works_as_in_stock() -> None:
    model, stock = SHAPE.build(7), SHAPE.build(7)
    lenses: dict[str, list[torch.Tensor]] = {"hooked": [], "stock": []}
    for name, m in (("hooked", model), ("stock", stock)):
        m.decoder.register_forward_hook(lambda mod, a, out, m=m, name=name: lenses[name].append(m.output_layer(out)[0].detach()))
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=4)
    stock_train_step(stock, batch)
    expected = stock_mtp_losses()
    hooked_train_step(model, hooks, batch)
    assert_same_mtp_losses(hooks.metrics(), expected)
    assert_same_grads(model, stock)
    assert len(lenses["hooked"]) == len(lenses["stock"]) == 1
    torch.testing.assert_close(lenses["hooked"][0], lenses["stock"][0], atol=0, rtol=0)


def _offload_marks(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if getattr(p, "_marked_not_offloadable", False)}


@pytest.fixture
def offloading_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fine-grained offloading's chunk handler makes CUDA streams, so (test-only) the handler is a
    no-op and the release's marking call (``mark_not_offloadable`` up to 0.18,
    ``mark_not_offload`` from 0.19) records each marked tensor. The layers' offloading needs CUDA
    too, so the forwards stop right after the marking (``Marked``)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as offload

    interface = offload.FineGrainedActivationOffloadingInterface
    monkeypatch.setattr(interface, "init_chunk_handler", staticmethod(lambda *a, **k: None))
    marking = [name for name in ("mark_not_offloadable", "mark_not_offload") if hasattr(interface, name)]
    assert marking, "this release marks parameters some other way"
    for name in marking:
        monkeypatch.setattr(interface, name, staticmethod(lambda t: setattr(t, "_marked_not_offloadable", True) if t is not None else None))


@pytest.mark.skipif(
    not hasattr(GPTModel, "preprocess_for_fine_grained_offloading"),
    reason="this megatron-core release has no fine-grained activation offloading (0.16+)",
)
def test_offloading_marks_equal_stock_when_the_first_forward_is_inference(offloading_on_cpu: None) -> None:
    """mcore marks the MTP parameters on the first forward only if ``mtp_process`` is set then."""

    class Marked(Exception):
        pass

    def stop(*_: Any) -> None:
        raise Marked  # right after GPTModel.forward marked the parameters, before the layers

    shape = TinyGPT(vocab_size=VOCAB, config_overrides={"fine_grained_activation_offloading": True, "offload_modules": ["attn_norm"]})
    model, stock = shape.build(7), shape.build(7)
    mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=5)
    for m in (model, stock):
        m.embedding.register_forward_pre_hook(stop)
    with torch.no_grad(), pytest.raises(Marked):
        model(*batch.model_args)  # an RL job's first forward: inference
    with torch.no_grad(), pytest.raises(Marked):
        stock(*batch.model_args, labels=batch.labels)  # stock needs labels; the marks come first
    marks = _offload_marks(stock)
    assert any(name.startswith("mtp.") for name in marks) and model.disable_param_offloading is False
    assert _offload_marks(model) == marks
    assert model.mtp_process is True and type(model.config) is TransformerConfig


def test_a_release_calling_the_output_layer_differently_is_refused_at_attach() -> None:
    model = SHAPE.build(7)
    layer_class = type(model.output_layer)

    class OtherRelease(layer_class):  # type: ignore[misc, valid-type]
        def forward(self, input_: torch.Tensor, weight: Any = None) -> Any:  # no runtime_gather_output
            return super().forward(input_, weight)

    model.output_layer.__class__ = OtherRelease  # test-only: how another release would look
    with pytest.raises(mtp_hooks.MTPHooksError, match="calls the output layer differently[\\s\\S]*runtime_gather_output"):
        mtp_hooks.attach(model)
    assert mtp_hooks.hooks_of(model) is None
    model.output_layer.__class__ = layer_class

"""Megatron's own training loop with hooks attached, against an unhooked stock twin.

The stack is Megatron's: the bf16 model inside ``Float16Module`` inside mcore's
``DistributedDataParallel`` (fp32 ``main_grad`` buffers, ``grad_reduce_in_fp32``), mcore's optimizer
(``get_megatron_optimizer``: fp32 main params and Adam moments in ``Float16OptimizerWithFloat16Params``;
torch's AdamW where Apex and Transformer Engine are absent), ``finalize_model_grads`` and
``get_forward_backward_func``. An RL loop runs on it: per rollout an inference pass through the
schedule (``forward_only``, ``eval()``, ``no_grad``) gives the old-policy log-probs, then two
optimizer steps of a clipped PPO loss over two training micro-batches each. After two rollouts the
model and optimizer are saved with ``dist_checkpointing``, loaded into a freshly built (differently
initialised) hooked stack, and a third rollout continues.

Stock twin: the same stack and batches, never hooked, running straight through without a checkpoint;
its micro-batches are stock's call with labels, whose per-token main loss is ``-log-prob`` (mcore
attaches the MTP loss itself). The hooked run computes its log-probs from the returned logits with
mcore's own ``compute_language_model_loss``, so both optimise the same objective and the schedules
set ``MTPLossAutoScaler``'s scale the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.mcore_cpu import make_batch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from tests.megatron_loop import (
    MegatronStack,
    assert_same_contents,
    flatten,
    ppo_loss,
    token_logprobs,
    build_stack,
    checkpoint_contents,
    hooked_logprobs,
    load_checkpoint,
    main_params_and_moments,
    make_rollout,
    run_rollouts,
    save_checkpoint,
    stock_logprobs,
    training_step,
    VOCAB,
)

SEED = 11
ROLLOUTS_BEFORE_SAVE = 2
ROLLOUTS_AFTER_LOAD = 1
STEPS_PER_ROLLOUT = 2


@dataclasses.dataclass
class StockRun:
    """What the never-hooked twin leaves behind."""

    initial: dict[str, torch.Tensor]
    final: dict[str, dict[str, torch.Tensor]]
    old_logprobs: list[list[torch.Tensor]]
    checkpoint: Path


@dataclasses.dataclass
class HookedRun:
    """What the hooked run (saved after two rollouts, resumed in a fresh stack) leaves behind."""

    final: dict[str, dict[str, torch.Tensor]]
    old_logprobs: list[list[torch.Tensor]]
    mtp_block_runs: int
    metrics: dict[str, float]
    checkpoint: Path


TRAINING_FORWARDS = (ROLLOUTS_BEFORE_SAVE + ROLLOUTS_AFTER_LOAD) * STEPS_PER_ROLLOUT * len(make_rollout(0).batches)


def _rollouts(start: int, count: int) -> list[Any]:
    return [make_rollout(i) for i in range(start, start + count)]


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory: pytest.TempPathFactory, one_intra_op_thread: None) -> StockRun:
    directory = tmp_path_factory.mktemp("stock") / "checkpoint"
    stock = build_stack(SEED)
    initial = {name: param.detach().clone() for name, param in stock.gpt.named_parameters()}
    old = run_rollouts(stock, _rollouts(0, ROLLOUTS_BEFORE_SAVE), stock_logprobs, STEPS_PER_ROLLOUT)
    save_checkpoint(stock, directory)
    old += run_rollouts(stock, _rollouts(ROLLOUTS_BEFORE_SAVE, ROLLOUTS_AFTER_LOAD), stock_logprobs, STEPS_PER_ROLLOUT)
    MTPLossLoggingHelper.tracker.clear()
    return StockRun(initial, main_params_and_moments(stock), old, directory)


@pytest.fixture(scope="module", params=["dense", "lean"])
def hooked_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, one_intra_op_thread: None) -> HookedRun:
    impl = request.param
    directory = tmp_path_factory.mktemp(f"hooked_{impl}") / "checkpoint"
    hooked = build_stack(SEED)
    hooks = mtp_hooks.attach(hooked.ddp, loss_impl=impl)
    mtp_runs: list[int] = []
    probe = hooked.gpt.mtp.register_forward_pre_hook(lambda module, args: mtp_runs.append(1))
    old = run_rollouts(hooked, _rollouts(0, ROLLOUTS_BEFORE_SAVE), hooked_logprobs, STEPS_PER_ROLLOUT)
    save_checkpoint(hooked, directory)
    probe.remove()
    metrics = hooks.metrics()
    hooks.remove()

    resumed = build_stack(SEED + 1)  # other initial weights: the checkpoint must overwrite every one
    resumed_hooks = mtp_hooks.attach(resumed.ddp, loss_impl=impl)
    load_checkpoint(resumed, directory)
    probe = resumed.gpt.mtp.register_forward_pre_hook(lambda module, args: mtp_runs.append(1))
    old += run_rollouts(resumed, _rollouts(ROLLOUTS_BEFORE_SAVE, ROLLOUTS_AFTER_LOAD), hooked_logprobs, STEPS_PER_ROLLOUT)
    probe.remove()
    resumed_hooks.remove()
    return HookedRun(main_params_and_moments(resumed), old, len(mtp_runs), metrics, directory)


def test_hooked_loop_with_checkpoint_round_trip_ends_with_stock_twins_params_and_optimizer_state(stock_run: StockRun, hooked_run: HookedRun) -> None:
    """Bit for bit: bf16 params, fp32 main params, Adam's moments and step (measured on 0.16.1)."""
    assert hooked_run.final.keys() == stock_run.final.keys()
    for name, expected in stock_run.final.items():
        assert not torch.equal(expected["param"], stock_run.initial[name]), f"{name} never moved: the comparison would be empty"
        actual = hooked_run.final[name]
        assert actual.keys() == expected.keys() == {"param", "main_param", "exp_avg", "exp_avg_sq", "step"}, name
        for key, tensor in expected.items():
            assert torch.equal(actual[key], tensor), f"{name} {key}: max diff {(actual[key].float() - tensor.float()).abs().max()}"


def test_inference_passes_return_stock_logprobs_and_never_run_mtp(stock_run: StockRun, hooked_run: HookedRun) -> None:
    for hooked, stock in zip(hooked_run.old_logprobs, stock_run.old_logprobs, strict=True):
        for actual, expected in zip(hooked, stock, strict=True):
            assert torch.equal(actual, expected)
    assert hooked_run.mtp_block_runs == TRAINING_FORWARDS, "the MTP block must run on training micro-batches only"
    assert set(hooked_run.metrics) >= {"mtp_1/loss", "mtp_2/loss"} and hooked_run.metrics["mtp_1/tokens"] > 0


def test_checkpoint_saved_with_hooks_holds_exactly_the_stock_twins_keys_and_tensors(stock_run: StockRun, hooked_run: HookedRun) -> None:
    stock = checkpoint_contents(stock_run.checkpoint)
    assert any(path.startswith("tensors/optimizer/") for path in stock) and any("/mtp.layers." in path for path in stock)
    assert_same_contents(checkpoint_contents(hooked_run.checkpoint), stock)


def test_checkpoint_saved_between_forward_and_backward_equals_one_saved_without_hooks(tmp_path: Path, one_intra_op_thread: None) -> None:
    stack = build_stack(SEED)
    hooks = mtp_hooks.attach(stack.ddp, detach_encoder=True)
    rollout = make_rollout(0)
    run_rollouts(stack, [rollout], hooked_logprobs, steps_per_rollout=1)  # Adam state to save
    batch = rollout.batches[0]
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = stack.ddp(*batch.model_args)
    save_checkpoint(stack, tmp_path / "in_flight")
    ppo_loss(rollout, 0, token_logprobs(stack.gpt, logits, batch.labels))[0].backward()
    hooks.remove()
    save_checkpoint(stack, tmp_path / "without_hooks")
    assert_same_contents(checkpoint_contents(tmp_path / "in_flight"), checkpoint_contents(tmp_path / "without_hooks"))


@pytest.mark.parametrize("detach_encoder", [False, True], ids=["attached", "detach_encoder"])
@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
def test_state_dicts_read_inside_a_hooked_forward_equal_stock(train: bool, detach_encoder: bool, one_intra_op_thread: None) -> None:
    """``state_dict()`` (module and DDP wrapper) and ``sharded_state_dict()`` read while the hooks
    hold their swaps (inside the MTP layers' or the output layer's forward) equal a never-hooked twin's."""
    stock, stack = build_stack(SEED), build_stack(SEED)
    expected = _state_dicts(stock)
    hooks = mtp_hooks.attach(stack.ddp, detach_encoder=detach_encoder)
    assert _same_state_dicts(_state_dicts(stack), expected)
    config = stack.gpt.config
    seen: list[tuple[bool, bool]] = []

    def read_state_dicts(module: Any, args: Any) -> None:
        swapped = stack.gpt.config is not config and (train or stack.gpt.mtp_process is False)
        seen.append((swapped, _same_state_dicts(_state_dicts(stack), expected)))

    where = stack.gpt.mtp.layers[-1] if train else stack.gpt.output_layer
    probe = where.register_forward_pre_hook(read_state_dicts)
    batch = make_rollout(0).batches[0]
    if train:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            stack.ddp(*batch.model_args)
    else:
        with torch.no_grad():
            stack.ddp(*batch.model_args)
    probe.remove()
    hooks.remove()
    assert seen == [(True, True)], "(read while the hooks' swaps are in place, equal to stock)"


def _state_dicts(stack: MegatronStack) -> dict[str, Any]:
    return {
        "gpt": flatten(stack.gpt.state_dict(), "gpt/"),
        "ddp": flatten(stack.ddp.state_dict(), "ddp/"),
        "sharded": {path: _sharded_leaf(leaf) for path, leaf in flatten(stack.gpt.sharded_state_dict(), "sharded/").items()},
    }


def _sharded_leaf(leaf: Any) -> Any:
    """A comparable summary of a ``ShardedTensor`` / ``ShardedObject`` / plain leaf."""
    if isinstance(leaf, ShardedTensor):
        return (leaf.key, leaf.data.clone(), leaf.global_shape, leaf.global_offset, leaf.replica_id, leaf.prepend_axis_num)
    if isinstance(leaf, ShardedObject):
        return (leaf.key, repr(leaf.data), leaf.global_shape, leaf.global_offset, leaf.replica_id)
    return repr(leaf) if not isinstance(leaf, torch.Tensor) else leaf.clone()


def _same_state_dicts(actual: dict[str, Any], expected: dict[str, Any]) -> bool:
    try:
        for part in expected:
            assert_same_contents(_as_tensors(actual[part]), _as_tensors(expected[part]))
    except AssertionError:
        return False
    return True


def _as_tensors(flat: dict[str, Any]) -> dict[str, Any]:
    """Expand summaries into (path/i -> item) so that ``assert_same_contents`` compares every item."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        if isinstance(value, tuple):
            out.update({f"{path}{i}": item for i, item in enumerate(value)})
        elif isinstance(value, torch.Tensor):
            out[path] = value.detach()
        else:
            out[path] = value
    return out


def test_loop_comparison_fails_when_the_hooked_mtp_weight_differs(one_intra_op_thread: None) -> None:
    """Control: with the hooks' MTP loss weighted 0.6 (stock: 0.3) one optimizer step already moves
    the MTP parameters away from the twin's, and the trunk's too."""
    stock, stack = build_stack(SEED), build_stack(SEED)
    mtp_hooks.attach(stack.ddp, loss_impl="dense", loss_scale=0.6)
    run_rollouts(stock, [make_rollout(0)], stock_logprobs, steps_per_rollout=1)
    run_rollouts(stack, [make_rollout(0)], hooked_logprobs, steps_per_rollout=1)
    expected, actual = main_params_and_moments(stock), main_params_and_moments(stack)
    differing = {name for name in expected if not torch.equal(actual[name]["main_param"], expected[name]["main_param"])}
    assert any(name.startswith("mtp.") for name in differing) and any(name.startswith("decoder.") for name in differing)

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

Also pinned: checkpoints and state dicts taken with hooks attached (inside a forward, between a
forward and its backward) equal stock's; one rollout under other settings Megatron users turn on
(per-token loss, constant loss scale, overlapped or bf16 grad reduce, ``DistributedOptimizer``);
schedules mixing main-loss-only micro-batches (no labels, gradients on) with training ones under
DDP, all with the dense loss, bit for bit. The lean loss rounds the head's weight gradient at other
points than stock (fp32 accumulation over all depths, rounded once), so its bf16 trajectory is not
stock's bit for bit and Adam's sign-like steps on near-zero gradient entries make multi-step
comparisons meaningless; its DDP gradients after one step through the same stack are pinned
within bf16 rounding of stock instead (``test_lean_gradients_through_the_megatron_stack_...``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import mtp_hooks
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.support.megatron_loop import (
    BF16_ATOL_OF_MAX,
    BF16_RTOL,
    MegatronStack,
    accumulate_gradients,
    assert_same_contents,
    assert_same_training_state,
    build_stack,
    checkpoint_contents,
    flatten,
    hooked_logprobs,
    inference_pass,
    load_checkpoint,
    main_params_and_moments,
    make_rollout,
    ppo_loss,
    run_rollouts,
    save_checkpoint,
    stock_logprobs,
    token_logprobs,
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
    impl: str


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


@pytest.fixture(scope="module", params=["dense"])
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
    return HookedRun(main_params_and_moments(resumed), old, len(mtp_runs), metrics, directory, impl)


def test_hooked_loop_with_checkpoint_round_trip_ends_with_stock_twins_params_and_optimizer_state(stock_run: StockRun, hooked_run: HookedRun) -> None:
    """Dense: bit for bit (bf16 params, fp32 main params, Adam's moments and step). Lean: within bf16
    rounding of stock (see ``assert_same_training_state``; measured bit for bit on 0.14.0-0.19.2)."""
    assert_same_training_state(hooked_run.final, stock_run.final, stock_run.initial, exact=hooked_run.impl == "dense")


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
    """``state_dict()`` (module and DDP wrapper) and ``sharded_state_dict()`` read from a user hook
    inside a hooked forward (the MTP layers' or the output layer's) equal a never-hooked twin's, and
    the model such a hook sees is stock: the hooks' swaps live only in a window no user hook runs in."""
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
    assert seen == [(False, True)], "(no swap visible to a user hook; state dicts equal stock)"


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


@pytest.mark.parametrize("impl", ["dense"])
def test_loop_comparison_fails_when_the_hooked_mtp_weight_differs(impl: str, one_intra_op_thread: None) -> None:
    """Control: with the hooks' MTP loss weighted 0.6 (stock: 0.3), one rollout moves MTP and trunk
    parameters away from the twin's, and the comparison fails, also within the bf16 tolerance
    (Adam's moments carry the gradients' scale)."""
    stock, stack = build_stack(SEED), build_stack(SEED)
    initial = {name: param.detach().clone() for name, param in stock.gpt.named_parameters()}
    mtp_hooks.attach(stack.ddp, loss_impl=impl, loss_scale=0.6)
    run_rollouts(stock, [make_rollout(0)], stock_logprobs, STEPS_PER_ROLLOUT)
    run_rollouts(stack, [make_rollout(0)], hooked_logprobs, STEPS_PER_ROLLOUT)
    expected, actual = main_params_and_moments(stock), main_params_and_moments(stack)
    differing = {name for name in expected if not torch.equal(actual[name]["main_param"], expected[name]["main_param"])}
    assert any(name.startswith("mtp.") for name in differing) and any(name.startswith("decoder.") for name in differing)
    with pytest.raises(AssertionError, match="exp_avg|main_param"):
        assert_same_training_state(actual, expected, initial, exact=False)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"config_overrides": {"calculate_per_token_loss": True}}, id="per_token_loss"),
        pytest.param({"optimizer_options": {"loss_scale": 1024.0}}, id="constant_loss_scale"),
        pytest.param({"ddp_options": {"overlap_grad_reduce": True}}, id="overlap_grad_reduce"),
        pytest.param({"ddp_options": {"grad_reduce_in_fp32": False}}, id="bf16_grad_reduce"),
        pytest.param(
            {"ddp_options": {"use_distributed_optimizer": True}, "optimizer_options": {"use_distributed_optimizer": True}},
            id="distributed_optimizer",
        ),
    ],
)
@pytest.mark.parametrize("impl", ["dense"])
def test_one_megatron_step_under_other_loop_settings_equals_stock(impl: str, options: dict[str, Any], one_intra_op_thread: None) -> None:
    """One rollout (inference pass, two optimizer steps) under settings Megatron users turn on:
    ``calculate_per_token_loss`` (``finalize_model_grads`` divides by the token count), a constant
    loss scale (the schedule scales ``MTPLossAutoScaler`` by it, the optimizer unscales), DDP's
    overlapped grad reduce (grad-ready hooks per parameter), bf16 gradient buffers and mcore's
    ``DistributedOptimizer`` (sharded fp32 main params, reduce-scatter, param all-gather)."""
    stock, stack = build_stack(SEED, **options), build_stack(SEED, **options)
    hooks = mtp_hooks.attach(stack.ddp, loss_impl=impl)
    initial = {name: param.detach().clone() for name, param in stock.gpt.named_parameters()}
    run_rollouts(stock, [make_rollout(0)], stock_logprobs, STEPS_PER_ROLLOUT)
    run_rollouts(stack, [make_rollout(0)], hooked_logprobs, STEPS_PER_ROLLOUT)
    hooks.remove()
    # Lean: bit for bit on 0.16.1 except with per-token loss, where the head weight's fp32 main
    # param differs by 3.4e-6 after two steps (rounding, within the bf16 tolerance).
    assert_same_training_state(main_params_and_moments(stack), main_params_and_moments(stock), initial, exact=impl == "dense")


OVERLAP_LAST_MICRO_BATCH_WITHOUT_MTP = (
    "mcore DDP with overlap_grad_reduce counts grad-ready parameters only in the last micro-batch and "
    "expects every parameter there; a last micro-batch without labels does not run the MTP block, so the "
    "MTP parameters' bucket never completes (AssertionError in the bucket's reset at the next zero_grad_buffer)"
)


def _index_of(rollout: Any, batch: Any) -> int:
    return next(i for i, b in enumerate(rollout.batches) if b is batch)


@pytest.mark.parametrize(
    "main_loss_only, overlap_grad_reduce",
    [
        pytest.param((1, 2), False, id="middle-sync_after"),
        pytest.param((1, 2), True, id="middle-overlap_grad_reduce"),
        pytest.param((1, 3), False, id="last-sync_after"),
        pytest.param(
            (1, 3),
            True,
            id="last-overlap_grad_reduce",
            marks=pytest.mark.xfail(reason=OVERLAP_LAST_MICRO_BATCH_WITHOUT_MTP, raises=AssertionError, strict=True),
        ),
    ],
)
@pytest.mark.parametrize("impl", ["dense"])
def test_schedule_mixing_main_loss_only_micro_batches_under_ddp_equals_stock(
    impl: str, main_loss_only: tuple[int, ...], overlap_grad_reduce: bool, one_intra_op_thread: None
) -> None:
    """Schedules of four micro-batches, two of them without labels but with gradients (the main
    loss trains the trunk; the MTP block does not run, so the MTP parameters' DDP grad hooks do not
    fire in them): ``main_grad`` accumulation, the reduce and the step equal stock, whose
    main-loss-only micro-batches run with ``mtp_loss_scaling_factor = 0``."""
    options = {"ddp_options": {"overlap_grad_reduce": overlap_grad_reduce}}
    stock, stack = build_stack(SEED, **options), build_stack(SEED, **options)
    initial = {name: param.detach().clone() for name, param in stock.gpt.named_parameters()}
    hooks = mtp_hooks.attach(stack.ddp, loss_impl=impl)
    mtp_runs: list[int] = []
    probe = stack.gpt.mtp.register_forward_pre_hook(lambda module, args: mtp_runs.append(1))
    stock_rollout, hooked_rollout = make_rollout(0, micro_batches=4), make_rollout(0, micro_batches=4)

    def stock_forward(run: MegatronStack, batch: Any, train: bool) -> torch.Tensor:
        if not (train and _index_of(stock_rollout, batch) in main_loss_only):
            return stock_logprobs(run, batch, train)
        factor = run.config.mtp_loss_scaling_factor
        run.config.mtp_loss_scaling_factor = 0.0
        try:
            return stock_logprobs(run, batch, train)
        finally:
            run.config.mtp_loss_scaling_factor = factor

    def hooked_forward(run: MegatronStack, batch: Any, train: bool) -> torch.Tensor:
        return hooked_logprobs(run, batch, train and _index_of(hooked_rollout, batch) not in main_loss_only)

    run_rollouts(stock, [stock_rollout], stock_forward, STEPS_PER_ROLLOUT)
    try:
        run_rollouts(stack, [hooked_rollout], hooked_forward, STEPS_PER_ROLLOUT)
    finally:
        probe.remove()
        hooks.remove()
    assert len(mtp_runs) == STEPS_PER_ROLLOUT * (4 - len(main_loss_only))
    assert_same_training_state(main_params_and_moments(stack), main_params_and_moments(stock), initial, exact=impl == "dense")


@pytest.mark.parametrize("impl", ["fused", "recompute"])
def test_lean_gradients_through_the_megatron_stack_equal_stock_within_bf16_rounding(impl: str, one_intra_op_thread: None) -> None:
    """One training step's micro-batches through the schedule, Float16Module(bf16) + mcore DDP:
    every fp32 ``main_grad`` of the hooked lean loss equals stock's within bf16 rounding."""
    stock, stack = build_stack(SEED), build_stack(SEED)
    hooks = mtp_hooks.attach(stack.ddp, loss_impl=impl)
    grads = []
    for run, logprobs_of in ((stock, stock_logprobs), (stack, hooked_logprobs)):
        rollout = make_rollout(0)
        inference_pass(run, rollout, logprobs_of)
        run.ddp.zero_grad_buffer()
        accumulate_gradients(run, rollout, logprobs_of)
        grads.append({name: param.main_grad.detach().clone() for name, param in run.gpt.named_parameters()})
    assert hooks.loss_path == impl
    hooks.remove()
    expected, actual = grads
    assert any(name.startswith("mtp.") and grad.any() for name, grad in expected.items())
    for name, reference in expected.items():
        atol = BF16_ATOL_OF_MAX * float(reference.abs().max())
        torch.testing.assert_close(actual[name], reference, rtol=BF16_RTOL, atol=atol, msg=lambda m: f"{name}: {m}")

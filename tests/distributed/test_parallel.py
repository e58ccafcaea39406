"""mtp_hooks against stock mcore at every parallel layout, on two CPU processes (gloo).

Every scenario runs on both ranks of one spawned group (``tests.support.distributed``): it builds a
stock model and a hooked twin with the same seed at the layout (checking their state dicts are
equal), runs the same micro-batch through both and compares, rank by rank, the main logits
(vocabulary shards with TP), the per-depth MTP losses (stock: mcore's tracker) and every
parameter's gradient. Layouts: TP=2, TP=2 with sequence parallelism, CP=2 (mcore's
load-balanced split, attention over the whole sequence), packed THD sequences (padded and not,
with TP=2 and with CP=2), PP=2 and PP=2 x VPP=2 through mcore's pipeline schedules.

MTP loss normalisation with CP: stock mcore 0.16.1 divides each depth's masked CE sum by the
masked-token count of *this CP rank* (no reduction over CP), and so do the hooks (the parity
tests pin it). With ``calculate_per_token_loss`` nothing is divided per rank, and the CP ranks'
objectives add up to the whole sequence's: ``test_context_parallel_adds_up_to_the_whole_sequence``
checks that against a CP=1 run of the full sequence (logits, CE sums, token counts; gradients
up to 0.16.1, since 0.17.1 rescales the per-token MTP loss by each rank's own token counts).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks import _mcore
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, context_parallel_positions, grads_of, make_batch, masked_mean
from mtp_hooks.testing import output_layer_calls, stock_mtp_losses
from tests.support.distributed import SpawnedGroup
from tests.support.megatron_loop import cuda_stream_on_cpu
from tests.support.pipeline_schedule import masked_sum_loss, run_schedule, stock_last_stage
from tests.support.mcore_cpu import needs_packed_mtp, rolled, thd_params

SEED = 1234


# ------------------------------------------------------------------ helpers run on every rank


def _build_twins(shape: TinyGPT, **model_kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """A stock model and its identical twin (same seed), checked equal parameter by parameter."""
    stock = shape.build(SEED, **model_kwargs)
    twin = shape.build(SEED, **model_kwargs)
    expected = {k: v for k, v in stock.state_dict().items() if isinstance(v, Tensor)}
    actual = {k: v for k, v in twin.state_dict().items() if isinstance(v, Tensor)}
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"twin builds differ at {name}"
    return stock, twin


def _stock_step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Tensor, loss_mask: Optional[Tensor]) -> dict[str, Any]:
    """Stock mcore training step: labels in, per-token loss out, backward of the masked mean."""
    with output_layer_calls(model) as calls:
        per_token = model(*args, labels=labels, loss_mask=loss_mask, **kwargs)
    loss = masked_mean(per_token, loss_mask)
    loss.backward()
    return {"logits": calls[-1].transpose(0, 1), "mtp_logits": calls[:-1], "loss": loss.detach(), "mtp": stock_mtp_losses()}


def _hooked_step(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Tensor, loss_mask: Optional[Tensor]
) -> dict[str, Any]:
    """The same step with hooks: logits out, the caller's own main loss, MTP trained by the hooks."""
    logits = model(*args, labels=labels, loss_mask=loss_mask, **kwargs)
    per_token = model.compute_language_model_loss(labels, logits.transpose(0, 1).clone(memory_format=torch.contiguous_format))
    loss = masked_mean(per_token, loss_mask)
    loss.backward()
    metrics = hooks.metrics()
    depth = hooks.depth
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        "mtp": [metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)],
        "acc": [metrics[f"mtp_{k}/acc"] for k in range(1, depth + 1)],
        "tokens": [metrics[f"mtp_{k}/tokens"] for k in range(1, depth + 1)],
    }


def _assert_parity(stock_out: dict[str, Any], hooked_out: dict[str, Any], stock: nn.Module, hooked: nn.Module) -> None:
    torch.testing.assert_close(hooked_out["logits"], stock_out["logits"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(hooked_out["loss"], stock_out["loss"])
    torch.testing.assert_close(hooked_out["mtp"], stock_out["mtp"], atol=1e-6, rtol=1e-5)
    assert_same_grads(hooked, stock)
    for name, p in hooked.named_parameters():
        if name.startswith("mtp."):
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: the MTP loss sent no gradient"


# ------------------------------------------------------------------ scenarios (run on every rank)


def scenario_tensor_parallel(sequence_parallel: bool, tied: bool, loss_impl: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    shape = TinyGPT(tied=tied, config_overrides={"sequence_parallel": sequence_parallel})
    stock, hooked = _build_twins(shape)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    block_outputs: list[tuple[int, ...]] = []
    hooked.mtp.register_forward_hook(lambda module, args, out: block_outputs.append(tuple(out.shape)))
    batch = make_batch(shape.vocab_size, batch=2, seq=8, seed=3)
    stock_out = _stock_step(stock, batch.model_args, {}, batch.labels, batch.loss_mask)
    hooked_out = _hooked_step(hooked, hooks, batch.model_args, {}, batch.labels, batch.loss_mask)
    # Sequence parallel: the MTP block hands the head [(1 + N) * s / tp, b, h].
    assert block_outputs == [((1 + 2) * (8 // 2 if sequence_parallel else 8), 2, shape.hidden_size)]
    assert hooked_out["logits"].shape == (2, 8, shape.vocab_size // 2)
    _assert_parity(stock_out, hooked_out, stock, hooked)
    # Acceptance: argmax over the whole vocabulary of stock's MTP logits (gathered shards).
    for k, shard in enumerate(stock_out["mtp_logits"], start=1):
        shards = [torch.empty_like(shard) for _ in range(2)]
        torch.distributed.all_gather(shards, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        predicted = torch.cat(shards, dim=-1).argmax(dim=-1).t()
        labels_k, mask_k = rolled(batch.labels, k), rolled(batch.loss_mask, k)
        expected = float(((predicted == labels_k).double() * mask_k).sum() / mask_k.sum())
        assert hooked_out["acc"][k - 1] == pytest.approx(expected, abs=1e-12), f"depth {k} acceptance"
    return {"mtp": hooked_out["mtp"], "acc": hooked_out["acc"], "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


def scenario_gathered_logits(loss_impl: str) -> None:
    """``runtime_gather_output=True``: full-vocabulary logits, the MTP loss still vocab-parallel.

    Stock mcore cannot be the reference on that call (its MTP and main CE would treat gathered
    logits as vocabulary shards), so it runs with shards; the hooked logits must be the
    all-gathered stock shards, and a plain CE on them must give stock's gradients.
    """
    import torch.nn.functional as F
    from megatron.core import parallel_state

    shape = TinyGPT()
    stock, hooked = _build_twins(shape)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    batch = make_batch(shape.vocab_size, batch=2, seq=8, seed=4)
    stock_out = _stock_step(stock, batch.model_args, {}, batch.labels, batch.loss_mask)
    logits = hooked(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, runtime_gather_output=True)
    assert logits.shape == (2, 8, shape.vocab_size)
    shards = [torch.empty_like(stock_out["logits"]) for _ in range(2)]
    torch.distributed.all_gather(shards, stock_out["logits"].contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    torch.testing.assert_close(logits.detach(), torch.cat(shards, dim=-1), atol=1e-6, rtol=1e-5)
    per_token = F.cross_entropy(logits.reshape(-1, shape.vocab_size), batch.labels.reshape(-1), reduction="none").view(2, 8)
    masked_mean(per_token, batch.loss_mask).backward()
    metrics = hooks.metrics()
    torch.testing.assert_close([metrics[f"mtp_{k}/loss"] for k in (1, 2)], stock_out["mtp"], atol=1e-6, rtol=1e-5)
    assert_same_grads(hooked, stock)


def _context_parallel_slice(batch: Batch, cp_rank: int, cp_size: int) -> Batch:
    index = context_parallel_positions(batch.input_ids.shape[1], cp_rank, cp_size)
    mask = None if batch.loss_mask is None else batch.loss_mask[:, index]
    return Batch(batch.input_ids[:, index], batch.position_ids[:, index], batch.labels[:, index], mask)


def scenario_context_parallel(loss_impl: str, per_token: bool) -> dict[str, Any]:
    from megatron.core import parallel_state

    cp_rank, cp_size = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()
    shape = TinyGPT(config_overrides={"calculate_per_token_loss": per_token})
    stock, hooked = _build_twins(shape)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    batch = _context_parallel_slice(make_batch(shape.vocab_size, batch=2, seq=16, seed=5), cp_rank, cp_size)
    stock_out = _stock_step(stock, batch.model_args, {}, batch.labels, batch.loss_mask)
    hooked_out = _hooked_step(hooked, hooks, batch.model_args, {}, batch.labels, batch.loss_mask)
    assert hooked_out["logits"].shape == (2, 16 // cp_size, shape.vocab_size)
    _assert_parity(stock_out, hooked_out, stock, hooked)
    return {"mtp": hooked_out["mtp"], "tokens": hooked_out["tokens"]}


def _per_token_step(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> tuple[Tensor, dict[str, float]]:
    """Hooked step whose main objective is the masked CE *sum*; returns logits and metrics."""
    logits = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    per_token = model.compute_language_model_loss(batch.labels, logits.transpose(0, 1).clone(memory_format=torch.contiguous_format))
    (per_token * batch.loss_mask).sum().backward()
    return logits.detach(), hooks.metrics()


def scenario_context_parallel_whole_sequence(loss_impl: str, gradients: bool) -> None:
    """CP=2 against CP=1 on the full sequence: logits, summed CE and token counts per depth and,
    with ``gradients``, summed gradients.

    With ``calculate_per_token_loss`` mcore up to 0.16.1 normalises nothing per rank, so the CP
    ranks' objectives add up to the full-sequence objective and their gradients to its gradients.
    """
    from megatron.core import parallel_state

    from mtp_hooks.testing import init_parallel

    shape = TinyGPT(config_overrides={"calculate_per_token_loss": True})
    full = make_batch(shape.vocab_size, batch=2, seq=16, seed=6)
    reference = shape.build(SEED)
    reference_logits, reference_metrics = _per_token_step(reference, mtp_hooks.attach(reference, loss_impl=loss_impl), full)
    reference_grads = grads_of(reference)

    init_parallel(context_parallel_size=2)
    cp_group = parallel_state.get_context_parallel_group()
    cp_rank = parallel_state.get_context_parallel_rank()
    model = shape.build(SEED)
    logits, metrics = _per_token_step(model, mtp_hooks.attach(model, loss_impl=loss_impl), _context_parallel_slice(full, cp_rank, 2))

    index = context_parallel_positions(16, cp_rank, 2)
    torch.testing.assert_close(logits, reference_logits[:, index], atol=1e-5, rtol=1e-5)
    for k in range(1, shape.mtp_num_layers + 1):
        sums = torch.tensor([metrics[f"mtp_{k}/loss"] * metrics[f"mtp_{k}/tokens"], metrics[f"mtp_{k}/tokens"]], dtype=torch.float64)
        torch.distributed.all_reduce(sums, group=cp_group)
        expected = [reference_metrics[f"mtp_{k}/loss"] * reference_metrics[f"mtp_{k}/tokens"], reference_metrics[f"mtp_{k}/tokens"]]
        torch.testing.assert_close(sums, torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-6)
    if not gradients:
        return
    for name, parameter in model.named_parameters():
        grad = parameter.grad.detach().clone()
        torch.distributed.all_reduce(grad, group=cp_group)
        torch.testing.assert_close(grad, reference_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def _pipeline_chunks(shape: TinyGPT, vpp: Optional[int]) -> list[nn.Module]:
    """This rank's model chunks (one per virtual stage), each built with the same seed."""
    from tests.support.pipeline_parity import pipeline_chunks

    return pipeline_chunks(shape, SEED, vpp)


def scenario_pipeline(tied: bool, loss_impl: str, vpp: Optional[int], labels_on_every_stage: bool) -> dict[str, Any]:
    """PP=2 (VPP optional) through mcore's schedule: hooks on every chunk against stock chunks.

    Compares every micro-batch's main logits and per-depth MTP losses on the last stage, then every
    parameter's gradient on every chunk; then an inference pass (no labels) through the schedule
    against stock's main logits.
    """
    from functools import partial

    from mtp_hooks.testing import cuda_calls_on_cpu

    # Unbatched p2p: with two ranks and VPP each rank both sends activations to and gradients
    # "back" to the same peer; gloo matches batched isend/irecv pairs in posting order, which
    # mcore's batched ordering does not keep (activations would arrive as gradients). The
    # unbatched path orders even and odd ranks so that they match.
    overrides: dict[str, Any] = {"batch_p2p_comm": False}
    if vpp:
        overrides["virtual_pipeline_model_parallel_size"] = vpp
    shape = TinyGPT(num_layers=2 * (vpp or 1), tied=tied, config_overrides=overrides)
    batches = [make_batch(shape.vocab_size, batch=2, seq=8, seed=10 + i) for i in range(4)]
    with cuda_calls_on_cpu():
        stock_chunks = _pipeline_chunks(shape, vpp)
        hooked_chunks = _pipeline_chunks(shape, vpp)
        for stock, hooked in zip(stock_chunks, hooked_chunks):
            expected = {k: v for k, v in stock.state_dict().items() if isinstance(v, Tensor)}
            for name, value in hooked.state_dict().items():
                if isinstance(value, Tensor):
                    assert torch.equal(value, expected[name]), f"twin chunks differ at {name}"
        hooks = [mtp_hooks.attach(chunk, loss_impl=loss_impl) for chunk in hooked_chunks]
        last = hooked_chunks[-1]
        is_last_stage = last.post_process
        depth = shape.mtp_num_layers

        stock_logits: list[Tensor] = []
        stock_mtp: list[list[float]] = []

        def stock_step(model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            targets = {"labels": batch.labels, "loss_mask": batch.loss_mask} if model.post_process or labels_on_every_stage else {}
            if not model.post_process:
                return model(*batch.model_args, **targets), None
            with stock_last_stage(model, depth, stock_logits, stock_mtp):
                per_token = model(*batch.model_args, **targets)
            return per_token, partial(masked_sum_loss, batch.loss_mask)

        hooked_logits: list[Tensor] = []
        hooked_mtp: list[list[float]] = []

        def hooked_step(model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            targets = {"labels": batch.labels, "loss_mask": batch.loss_mask} if model.post_process or labels_on_every_stage else {}
            output = model(*batch.model_args, **targets)
            if not model.post_process:
                return output, None
            hooked_logits.append(output.detach().clone())
            metrics = mtp_hooks.hooks_of(model).metrics()
            hooked_mtp.append([metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)])

            def loss(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
                per_token = model.compute_language_model_loss(batch.labels, logits.transpose(0, 1).clone(memory_format=torch.contiguous_format))
                return masked_sum_loss(batch.loss_mask, per_token)

            return output, loss

        run_schedule(stock_chunks, batches, stock_step)
        run_schedule(hooked_chunks, batches, hooked_step)

        if is_last_stage:
            assert len(hooked_logits) == len(stock_logits) == len(batches)
            for actual, expected in zip(hooked_logits, stock_logits):
                torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(hooked_mtp, stock_mtp, atol=1e-6, rtol=1e-5)
        for stock, hooked in zip(stock_chunks, hooked_chunks):
            assert_same_grads(hooked, stock)
            if hooked.mtp_process:
                for name, p in hooked.mtp.named_parameters():
                    assert p.grad is not None and p.grad.abs().sum() > 0, f"mtp.{name}: no gradient from the MTP loss"

        # Inference micro-batches (no labels): the MTP block is skipped; logits are stock's.
        inference_logits: list[Tensor] = []

        def inference_step(model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
            output = model(*batch.model_args)
            if not model.post_process:
                return output, None
            inference_logits.append(output.detach().clone())
            return output, lambda logits: (logits.sum() * 0, torch.tensor(1, dtype=torch.int), {})

        run_schedule(hooked_chunks, batches, inference_step, forward_only=True)
        if is_last_stage:
            for actual, expected in zip(inference_logits, stock_logits):
                torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
        for h in hooks:
            h.remove()
    return {"last_stage": is_last_stage, "mtp": hooked_mtp, "chunks": len(hooked_chunks)}


def _packed_batch(vocab_size: int, real: list[int], slot: list[int], seed: int) -> tuple[Batch, Any, Any]:
    """A THD micro-batch (``b == 1``): sequences of ``real`` tokens in slots of ``slot`` tokens.

    Positions restart in every sequence; the last real token of a sequence and the padding have
    mask 0. Returns the batch, its ``PackedSeqParams`` (real lengths in ``cu_seqlens_q``, slots in
    ``cu_seqlens_q_padded`` when they differ) and the same params with ``cu_seqlens_q`` set to the
    slots (how Megatron-LM, verl and NeMo-RL describe padded batches to mcore).
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(slot)
    ids = torch.zeros(1, total, dtype=torch.long)
    positions = torch.zeros(1, total, dtype=torch.long)
    labels = torch.zeros(1, total, dtype=torch.long)
    loss_mask = torch.zeros(1, total)
    start = 0
    for n, size in zip(real, slot):
        tokens = torch.randint(0, vocab_size, (n,), generator=gen)
        ids[0, start : start + n] = tokens
        positions[0, start : start + size] = torch.arange(size)
        labels[0, start : start + n - 1] = tokens[1:]
        loss_mask[0, start : start + n - 1] = (torch.rand(n - 1, generator=gen) > 0.2).float() if n > 1 else torch.zeros(0)
        start += size
    return (Batch(ids, positions, labels, loss_mask), *thd_params(real, slot))


def scenario_packed_sequences(padded: bool, loss_impl: str) -> dict[str, Any]:
    """THD batch: hooks given the caller's params against stock given the slot layout.

    With padding, stock mcore is also run on the caller's params: its rolls then use the
    unpadded lengths over the padded row and its MTP losses must differ (targets crossing
    sequences), which is what the hooks avoid.
    """
    shape = TinyGPT()
    real = [5, 2, 1, 7]  # 2 and 1 tokens: shorter than N + 1 = 3
    slot = [8, 4, 4, 8] if padded else real
    batch, given, layout = _packed_batch(shape.vocab_size, real, slot, seed=7)
    stock, hooked = _build_twins(shape)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    stock_out = _stock_step(stock, batch.model_args, {"packed_seq_params": layout}, batch.labels, batch.loss_mask)
    hooked_out = _hooked_step(hooked, hooks, batch.model_args, {"packed_seq_params": given}, batch.labels, batch.loss_mask)
    _assert_parity(stock_out, hooked_out, stock, hooked)
    if padded:
        naive = shape.build(SEED)
        naive_out = _stock_step(naive, batch.model_args, {"packed_seq_params": given}, batch.labels, batch.loss_mask)
        assert not torch.allclose(torch.tensor(naive_out["mtp"]), torch.tensor(hooked_out["mtp"], dtype=torch.float32))
    return {"mtp": hooked_out["mtp"], "tokens": hooked_out["tokens"]}


def _slice_packed(batch: Batch, layout: Any, cp_rank: int, cp_size: int) -> Batch:
    """This CP rank's part of a packed row: chunks r and 2cp-1-r of every slot."""
    bounds = layout.cu_seqlens_q_padded if layout.cu_seqlens_q_padded is not None else layout.cu_seqlens_q
    index = context_parallel_positions(bounds.tolist(), cp_rank, cp_size)
    return Batch(batch.input_ids[:, index], batch.position_ids[:, index], batch.labels[:, index], batch.loss_mask[:, index])


def scenario_packed_context_parallel(padded: bool, loss_impl: str) -> dict[str, Any]:
    """THD with CP=2: slots split 4 ways, cu_seqlens global (as mcore expects), hooks vs stock."""
    from megatron.core import parallel_state

    cp_rank = parallel_state.get_context_parallel_rank()
    shape = TinyGPT()
    slot = [8, 4, 8, 4]  # divisible into 2cp = 4 chunks, as mcore's CP split of THD needs
    real = [7, 3, 8, 1] if padded else slot
    batch, given, layout = _packed_batch(shape.vocab_size, real, slot, seed=8)
    local = _slice_packed(batch, layout, cp_rank, 2)
    stock, hooked = _build_twins(shape)
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)
    stock_out = _stock_step(stock, local.model_args, {"packed_seq_params": layout}, local.labels, local.loss_mask)
    hooked_out = _hooked_step(hooked, hooks, local.model_args, {"packed_seq_params": given}, local.labels, local.loss_mask)
    _assert_parity(stock_out, hooked_out, stock, hooked)
    return {"tokens": hooked_out["tokens"]}


def scenario_targets_context_parallel(examples: int, packed: bool) -> int:
    """``mtp_targets`` with a CP group against the brute-force reference on the full row.

    Random plain ``[b, s]`` rows, or packed rows (slots divisible by 2cp, random real lengths,
    padded or not, masks or none); every rank checks its own part, so boundary tokens must come
    from the other rank. Returns how many counted targets were compared.
    """
    import random

    from megatron.core import parallel_state

    from tests.unit.test_targets import Slot, packed_params, reference_targets

    cp_group = parallel_state.get_context_parallel_group()
    cp_rank = cp_group.rank()
    rng = random.Random(11)  # the same draws on both ranks
    checked = 0
    for example in range(examples):
        depth = rng.randint(1, 4)
        gen = torch.Generator().manual_seed(example)
        if not packed:
            s = 4 * rng.randint(1, 4)
            labels = torch.randint(0, 50, (2, s), generator=gen)
            loss_mask = (torch.rand(2, s, generator=gen) > 0.3).float()
            expected = reference_targets(labels, loss_mask, depth, None)
            index = context_parallel_positions(s, cp_rank, 2)
            actual = mtp_hooks.mtp_targets(labels[:, index], loss_mask[:, index], depth, cp_group=cp_group)
        else:
            padded = example % 2 == 1
            slots, start = [], 0
            for _ in range(rng.randint(1, 4)):
                size = 4 * rng.randint(0, 3)
                real = rng.randint(0, size) if padded else size
                slots.append(Slot(start, size, real))
                start += size
            labels = torch.randint(0, 50, (1, start), generator=gen)
            loss_mask = None if example % 3 == 0 else (torch.rand(1, start, generator=gen) > 0.3).float()
            params = packed_params(slots, padded)
            expected = reference_targets(labels, loss_mask, depth, slots)
            index = context_parallel_positions([0, *[slot.start + slot.size for slot in slots]], cp_rank, 2)
            local_mask = None if loss_mask is None else loss_mask[:, index]
            actual = mtp_hooks.mtp_targets(labels[:, index], local_mask, depth, packed_seq_params=params, cp_group=cp_group)
        for k, ((labels_k, mask_k), (ref_labels, ref_mask)) in enumerate(zip(actual, expected), start=1):
            ref_labels, ref_mask = ref_labels[:, index], ref_mask[:, index]
            assert torch.equal(mask_k, ref_mask), f"example {example}, depth {k}: mask {mask_k.tolist()} != {ref_mask.tolist()}"
            counted = ref_mask != 0
            assert torch.equal(labels_k[counted], ref_labels[counted]), f"example {example}, depth {k}: labels"
            checked += int(counted.sum())
    return checked


# ------------------------------------------------------------------ tests


TP2 = {"tensor_model_parallel_size": 2}


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_tensor_parallel_matches_stock(group: SpawnedGroup, sequence_parallel: bool, loss_impl: str) -> None:
    results = group.run(scenario_tensor_parallel, TP2, sequence_parallel=sequence_parallel, tied=False, loss_impl=loss_impl)
    assert [r["tp_rank"] for r in results] == [0, 1]
    assert results[0]["mtp"] == pytest.approx(results[1]["mtp"], rel=1e-6)
    assert results[0]["acc"] == results[1]["acc"]  # acceptance reduced over the vocabulary shards


def test_tensor_parallel_with_tied_embeddings_matches_stock(group: SpawnedGroup) -> None:
    group.run(scenario_tensor_parallel, TP2, sequence_parallel=True, tied=True, loss_impl="lean")


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_runtime_gather_output_returns_full_vocabulary_logits(group: SpawnedGroup, loss_impl: str) -> None:
    group.run(scenario_gathered_logits, TP2, loss_impl=loss_impl)


CP2 = {"context_parallel_size": 2}


@pytest.mark.parametrize("per_token", [False, True], ids=["per_rank_mean", "per_token"])
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_context_parallel_matches_stock(group: SpawnedGroup, loss_impl: str, per_token: bool) -> None:
    results = group.run(scenario_context_parallel, CP2, loss_impl=loss_impl, per_token=per_token)
    assert results[0]["tokens"] != results[1]["tokens"]  # each CP rank scores its own half


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_context_parallel_adds_up_to_the_whole_sequence(group: SpawnedGroup, loss_impl: str) -> None:
    group.run(scenario_context_parallel_whole_sequence, {}, loss_impl=loss_impl, gradients=False)


@pytest.mark.skipif(
    _mcore.PER_TOKEN_LOSS_RESCALED,
    reason="megatron-core >= 0.17.1 rescales the per-token MTP loss by this CP rank's token counts "
    "(original / rolled), so the CP ranks' gradients no longer add up to the whole sequence's",
)
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_context_parallel_gradients_add_up_to_the_whole_sequence(group: SpawnedGroup, loss_impl: str) -> None:
    group.run(scenario_context_parallel_whole_sequence, {}, loss_impl=loss_impl, gradients=True)


PP2 = {"pipeline_model_parallel_size": 2}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("vpp", [None, 2], ids=["pp2", "pp2_vpp2"])
def test_pipeline_schedule_matches_stock(group: SpawnedGroup, vpp: Optional[int], tied: bool) -> None:
    layout = dict(PP2, virtual_pipeline_model_parallel_size=vpp)
    results = group.run(scenario_pipeline, layout, tied=tied, loss_impl="lean", vpp=vpp, labels_on_every_stage=vpp is not None)
    assert [r["last_stage"] for r in results] == [False, True]
    assert results[1]["mtp"] and all(len(losses) == 2 for losses in results[1]["mtp"])


@needs_packed_mtp
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("padded", [False, True], ids=["thd", "thd_padded"])
def test_packed_sequences_match_stock_with_tensor_parallel(group: SpawnedGroup, padded: bool, loss_impl: str) -> None:
    results = group.run(scenario_packed_sequences, TP2, padded=padded, loss_impl=loss_impl)
    assert results[0]["tokens"] == results[1]["tokens"]


@needs_packed_mtp
@pytest.mark.parametrize("padded", [False, True], ids=["thd", "thd_padded"])
def test_packed_sequences_match_stock_with_context_parallel(group: SpawnedGroup, padded: bool) -> None:
    results = group.run(scenario_packed_context_parallel, CP2, padded=padded, loss_impl="lean")
    assert results[0]["tokens"] != results[1]["tokens"]


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_packed_mtp)], ids=["bshd", "thd"])
def test_mtp_targets_with_context_parallel_follow_the_contract(group: SpawnedGroup, packed: bool) -> None:
    checked = group.run(scenario_targets_context_parallel, CP2, examples=40, packed=packed)
    assert min(checked) > 100  # enough targets were compared on both ranks


def _stage_model(post_process: bool, with_mtp: bool, pre_process: bool = True, tied: bool = False) -> nn.Module:
    """One stage of a pipeline layout, as mcore builds it (single process)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    from mtp_hooks.testing import SDPAttention, environ_kept

    shape = TinyGPT(tied=tied)
    config = shape.config()
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if with_mtp else None
    with environ_kept():
        return GPTModel(
            config=config, transformer_layer_spec=spec, mtp_block_spec=mtp_spec, pre_process=pre_process, post_process=post_process,
            **shape.model_arguments(),
        )


@pytest.mark.parametrize(
    ("post_process", "with_mtp"), [(True, False), (False, True)], ids=["output_stage_without_mtp", "mtp_stage_without_output"]
)
def test_mtp_on_another_stage_than_the_output_layer_is_refused(post_process: bool, with_mtp: bool) -> None:
    model = _stage_model(post_process, with_mtp)
    with pytest.raises(mtp_hooks.MTPHooksError, match="another pipeline stage than the output layer"):
        mtp_hooks.attach(model)
    assert mtp_hooks.hooks_of(model) is None


def _last_stage_step(model: nn.Module, hooks: mtp_hooks.MTPHooks) -> None:
    """One training micro-batch on a last pipeline stage: the previous stage's hidden states in, main CE out, backward."""
    from mtp_hooks.testing import main_ce_from_logits

    batch = make_batch(64, seq=8, seed=3)
    model.set_input_tensor(torch.randn(8, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(4)))
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()


@pytest.mark.parametrize("detach_encoder", [False, True])
def test_detach_encoder_leaves_a_later_stages_embedding_copy_without_gradient(detach_encoder: bool) -> None:
    """Why it is refused under overlapped grad reduction: after the first pipeline stage the word
    embeddings are a copy only the MTP layers use, and ``detach_encoder`` detaches their output."""
    model = _stage_model(post_process=True, with_mtp=True, pre_process=False)
    with mtp_hooks.attached(model, detach_encoder=detach_encoder) as hooks:
        _last_stage_step(model, hooks)
    grad = model.embedding.word_embeddings.weight.grad
    assert (grad is None) == detach_encoder
    assert model.mtp.layers[0].eh_proj.weight.grad is not None  # the MTP layers trained either way


def _ddp(model: nn.Module, overlap_grad_reduce: bool, align_grad_reduce: bool = False) -> nn.Module:
    """mcore DDP around ``model``, the schedule's hooks wired as Megatron's ``training.py`` wires them
    (with ``overlap_grad_reduce``: ``no_sync_func``, and ``grad_sync_func`` under ``align_grad_reduce``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce), model)
    if overlap_grad_reduce:
        ddp.config.no_sync_func = ddp.no_sync
        if align_grad_reduce:
            ddp.config.grad_sync_func = ddp.start_grad_sync
    return ddp


def test_detach_encoder_on_a_later_stage_under_overlapped_grad_reduce_without_align_is_refused_at_attach() -> None:
    model = _stage_model(post_process=True, with_mtp=True, pre_process=False)
    ddp = _ddp(model, overlap_grad_reduce=True, align_grad_reduce=False)
    with pytest.raises(mtp_hooks.MTPHooksError, match=r"^detach_encoder: .*overlap_grad_reduce.*no grad_sync_func.*\n.*align_grad_reduce=True.*overlap_grad_reduce=False.*\n.*received: detach_encoder=True under a DistributedDataParallel.*grad_sync_func None"):
        mtp_hooks.attach(ddp, detach_encoder=True)
    assert mtp_hooks.hooks_of(ddp) is None


def test_detach_encoder_on_a_later_stage_under_aligned_overlapped_grad_reduce_is_attached() -> None:
    """Megatron's default wiring (``align_grad_reduce``): a stage after the first counts no gradient,
    so DDP never asserts (the parity matrix's overlapped ``detach_encoder`` cases train it equal to stock)."""
    model = _stage_model(post_process=True, with_mtp=True, pre_process=False)
    mtp_hooks.attach(_ddp(model, overlap_grad_reduce=True, align_grad_reduce=True), detach_encoder=True).remove()


@pytest.mark.parametrize("align_grad_reduce", [False, True], ids=["no_sync_func_alone", "align_grad_reduce"])
def test_overlapped_grad_reduce_asserts_on_the_idle_copy_only_without_align(align_grad_reduce: bool) -> None:
    """Why the refusal needs ``no_sync_func`` without ``grad_sync_func``: two steps of two micro-batches on
    a later stage, grad sync toggled as mcore's schedules toggle it there (without ``grad_sync_func``
    the last micro-batch's backward runs with sync on; with it, none does and the schedule calls it
    after the last backward). DDP asserts within two steps without align only."""
    model = _stage_model(post_process=True, with_mtp=True, pre_process=False)
    ddp = _ddp(model, overlap_grad_reduce=True, align_grad_reduce=align_grad_reduce)
    hooks = mtp_hooks.attach(model, detach_encoder=True)  # the language model: no wiring seen, attached

    def step() -> None:
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            _last_stage_step(model, hooks)
            if align_grad_reduce:
                _last_stage_step(model, hooks)
        if not align_grad_reduce:
            _last_stage_step(model, hooks)
        else:
            ddp.config.grad_sync_func()
        ddp.finish_grad_sync()

    with cuda_stream_on_cpu():  # 0.19's grad sync asks torch.cuda.current_stream()
        if align_grad_reduce:
            step()
            step()
            assert model.mtp.layers[0].eh_proj.weight.main_grad.any()
        else:  # 0.15+ assert at the second step's zero_grad_buffer, 0.14 already in the first's finish_grad_sync
            with pytest.raises(AssertionError):
                step()
                step()
    hooks.remove()


@pytest.mark.parametrize(
    ("pre_process", "tied", "overlap_grad_reduce", "detach_encoder"),
    [(True, False, True, True), (False, True, True, True), (False, False, False, True), (False, False, True, False)],
    ids=["first_stage", "tied_heads", "no_overlap", "no_detach_encoder"],
)
def test_what_overlapped_grad_reduce_can_run_is_attached(pre_process: bool, tied: bool, overlap_grad_reduce: bool, detach_encoder: bool) -> None:
    """The refusal is that case alone: a stage holding the real embeddings, a copy the tied main head
    trains, synchronous grad reduction, or MTP gradients into the copy all attach."""
    model = _stage_model(post_process=True, with_mtp=True, pre_process=pre_process, tied=tied)
    hooks = mtp_hooks.attach(_ddp(model, overlap_grad_reduce), detach_encoder=detach_encoder)
    hooks.remove()

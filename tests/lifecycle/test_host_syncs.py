"""No host sync in a micro-batch by default, like stock mcore: every forward is a hot path.

The counters are the benchmark's (``benchmarks.counters``, pinned by ``tests/repo/test_bench_counters.py``):
``HostSyncs`` (values read by the host) and ``HostToDevice`` (tensors made from host data, a blocking
host-to-device copy each on a GPU).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import mtp_hooks
from benchmarks.counters import HostReads, HostSyncs, HostToDevice
from mtp_hooks import _mcore
from mtp_hooks.testing import Batch, TinyGPT, hooked_train_step, main_ce_from_logits, make_batch, masked_mean
from tests.support.mcore_cpu import thd_params

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)


@pytest.mark.parametrize("per_token", [False, True], ids=["token mean", "calculate_per_token_loss"])
@pytest.mark.parametrize("mask", ["none", "random"])
@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}, {"output": "logprobs"}], ids=["lean", "dense", "logprobs"])
def test_micro_batches_build_no_tensor_from_host_data(options: dict[str, Any], mask: str, per_token: bool) -> None:
    """Training and inference micro-batches, ``loss_mask=None`` and per-token loss included. The
    dense path runs mcore's own CE per depth, which lifts one host scalar per call
    (``masked_target[target_mask] = 0``): no more than stock's micro-batch, which runs it too."""
    spec = TinyGPT(vocab_size=VOCAB, config_overrides={"calculate_per_token_loss": per_token})
    model = spec.build()
    hooks = mtp_hooks.attach(model, **options)
    batch = make_batch(VOCAB, mask=mask, seed=5)
    with HostToDevice() as host_data, HostSyncs() as syncs:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            out = model(*batch.model_args)
        logits = out.logprobs if options.get("output") == "logprobs" else out
        logits.float().sum().backward()
        with torch.no_grad():
            if options.get("output") == "logprobs":
                model(*batch.model_args, labels=batch.labels)
            else:
                model(*batch.model_args)
    assert syncs.count == 0, dict(syncs.by_op)
    if options.get("loss_impl") != "dense":
        assert host_data.count == 0, dict(host_data.by_op)
        return
    stock = spec.build()
    with HostToDevice() as stock_host_data:
        stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask).sum().backward()
    assert 0 < host_data.count <= stock_host_data.count, (dict(host_data.by_op), dict(stock_host_data.by_op))


@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}, {"detach_encoder": True, "detach_head": True}], ids=["lean", "dense", "detached"])
def test_training_micro_batch_makes_no_host_sync_by_default(options: dict[str, Any]) -> None:
    """Stock makes none either on 0.14 - 0.16 and 0.18+ (0.17.1 tests ``num_tokens > 0`` on the host)."""
    hooked = SHAPE.build()
    batch = make_batch(VOCAB, seed=1)
    hooks = mtp_hooks.attach(hooked, **options)
    with HostSyncs() as syncs:
        hooked_train_step(hooked, hooks, batch)
    assert syncs.count == 0, dict(syncs.by_op)
    assert hooks.metrics()["mtp_1/tokens"] > 0  # it did train


def test_inference_micro_batch_makes_no_host_sync() -> None:
    model = SHAPE.build()
    mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=2)
    with HostSyncs() as syncs, torch.no_grad():
        model(*batch.model_args)
    assert syncs.count == 0, dict(syncs.by_op)


def test_host_validation_is_the_one_that_syncs() -> None:
    """The counter sees syncs when there are some: ``validate="host"`` makes two (mask, labels)."""
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, validate="host")
    batch = make_batch(VOCAB, seed=3)
    with HostSyncs() as syncs:
        hooked_train_step(model, hooks, batch)
    assert syncs.count == 2, dict(syncs.by_op)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.set_sync_debug_mode)")
def test_training_micro_batch_on_cuda_passes_sync_debug_mode_error() -> None:  # pragma: no cover - GPU only
    model = SHAPE.build().cuda()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=4)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    labels, mask = cuda(batch.labels), cuda(batch.loss_mask)
    ids, positions = cuda(batch.input_ids), cuda(batch.position_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with HostToDevice() as host_data:
            with hooks.micro_batch(labels, mask):
                logits = model(ids, positions, None)
            logits.float().logsumexp(-1).sum().backward()
            with hooks.micro_batch(labels, None):  # loss_mask=None
                logits = model(ids, positions, None)
            logits.float().logsumexp(-1).sum().backward()
            with torch.no_grad():
                model(ids, positions, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert host_data.count == 0, dict(host_data.by_op)
    assert hooks.metrics()["mtp_1/tokens"] > 0


@pytest.mark.skipif(not _mcore.ROLLS_PACKED_SEQUENCES, reason="megatron-core < 0.16.1 refuses MTP with packed sequences")
@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}], ids=["lean", "dense"])
def test_packed_micro_batches_sync_no_more_than_stock(options: dict[str, Any]) -> None:
    """mcore's own rolls read ``cu_seqlens`` on the host (stock's syncs); the hooks' packed work
    (real-token mask, layout checks) adds none, and the inference micro-batch makes none at all."""
    from tests.parity.test_side_by_side import VOCAB as PACKED_VOCAB
    from tests.parity.test_side_by_side import packed_batch

    batch, params = packed_batch()
    spec = TinyGPT(vocab_size=PACKED_VOCAB)
    stock, hooked = spec.build(), spec.build()
    with HostSyncs() as stock_syncs, HostToDevice() as stock_h2d:
        per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, packed_seq_params=params)
        masked_mean(per_token, batch.loss_mask).backward()
    hooks = mtp_hooks.attach(hooked, **options)
    with HostSyncs() as syncs, HostToDevice() as h2d:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            logits = hooked(*batch.model_args, packed_seq_params=params)
        masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
    assert syncs.count <= stock_syncs.count, (dict(syncs.by_op), dict(stock_syncs.by_op))
    assert h2d.count <= stock_h2d.count, (dict(h2d.by_op), dict(stock_h2d.by_op))
    assert hooks.metrics()["mtp_1/tokens"] > 0
    with HostSyncs() as syncs, HostToDevice() as h2d, torch.no_grad():
        hooked(*batch.model_args, packed_seq_params=params)
    assert syncs.count == 0 and h2d.count == 0, (dict(syncs.by_op), dict(h2d.by_op))


@pytest.mark.skipif(not _mcore.ROLLS_PACKED_SEQUENCES, reason="megatron-core < 0.16.1 refuses MTP with packed sequences")
def test_packed_targets_make_no_host_sync_of_their_own() -> None:
    """``mtp_targets`` on a packed row: every sync and host read it makes is inside mcore's ``roll_tensor``
    (``HostReads`` also sees ``tolist``, which dispatches nothing on CPU)."""
    from tests.parity.test_side_by_side import packed_batch

    batch, params = packed_batch()
    with HostSyncs() as all_syncs, HostReads() as all_reads:
        mtp_hooks.mtp_targets(batch.labels, batch.loss_mask, 2, packed_seq_params=params)
    with HostSyncs() as roll_syncs, HostReads() as roll_reads:  # the same rolls, alone
        for tensor in (batch.labels, batch.loss_mask.float()):
            rolled = tensor
            for _ in range(2):
                rolled, _sum = _mcore.roll_left(rolled, None, params)
    assert all_syncs.count == roll_syncs.count, (dict(all_syncs.by_op), dict(roll_syncs.by_op))
    assert all_reads.by_op == roll_reads.by_op, (dict(all_reads.by_op), dict(roll_reads.by_op))


def padded_packed_batch() -> tuple[Batch, Any, Any]:
    """One THD row of sequences of 5, 2 and 6 real tokens in slots of 8, 4 and 8: the batch, the
    caller's params (``cu_seqlens_q_padded`` distinct) and the slot layout stock is given."""
    real, slot = [5, 2, 6], [8, 4, 8]
    gen = torch.Generator().manual_seed(11)
    ids, positions, labels = (torch.zeros(1, sum(slot), dtype=torch.long) for _ in range(3))
    loss_mask, start = torch.zeros(1, sum(slot)), 0
    for n, size in zip(real, slot):
        tokens = torch.randint(0, VOCAB, (n,), generator=gen)
        ids[0, start : start + n] = tokens
        positions[0, start : start + size] = torch.arange(size)
        labels[0, start : start + n - 1] = tokens[1:]
        loss_mask[0, start : start + n - 1] = 1.0
        start += size
    return (Batch(ids, positions, labels, loss_mask), *thd_params(real, slot))


def host_reads(syncs: HostSyncs, reads: HostReads) -> int:
    """Host reads of values as a GPU would sync on them: the ops ``HostSyncs`` sees, plus ``tolist``,
    which dispatches no op on CPU (``int()`` / ``item()`` / ``bool()`` dispatch one, already counted)."""
    return syncs.count + reads.by_op["tolist"]


def packed_step_reads(model: torch.nn.Module, hooks: Optional[mtp_hooks.MTPHooks], batch: Batch, params: Any) -> int:
    """``host_reads`` of one packed training micro-batch, forward and backward (stock: ``hooks=None``)."""
    with HostSyncs() as syncs, HostReads() as reads:
        if hooks is None:
            per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask, packed_seq_params=params)
        else:
            with hooks.micro_batch(batch.labels, batch.loss_mask):
                per_token = main_ce_from_logits(model(*batch.model_args, packed_seq_params=params), batch.labels)
        masked_mean(per_token, batch.loss_mask).backward()
    return host_reads(syncs, reads)


@pytest.mark.skipif(not _mcore.ROLLS_PACKED_SEQUENCES, reason="megatron-core < 0.16.1 refuses MTP with packed sequences")
@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}, {"agreement_metrics": True}], ids=["lean", "dense", "agreement"])
def test_padded_packed_micro_batch_reads_the_host_no_more_than_stock(options: dict[str, Any]) -> None:
    """A distinct ``cu_seqlens_q_padded`` costs no host read (docs/contract.md): the MTP layers and the
    targets share that layout, its ``max_seqlen`` the caller's. Against the same hooks given the slot
    layout itself (no distinct padded bounds), and against stock given it (agreement metrics roll the
    main head's input too, with mcore's rolls: stock has no such work)."""
    batch, given, layout = padded_packed_batch()
    hooked = SHAPE.build()
    hooks = mtp_hooks.attach(hooked, **options)
    padded = packed_step_reads(hooked, hooks, batch, given)
    assert padded == packed_step_reads(hooked, hooks, batch, layout)
    if not options.get("agreement_metrics"):
        assert padded <= packed_step_reads(SHAPE.build(), None, batch, layout)
    assert hooks.metrics()["mtp_1/tokens"] > 0

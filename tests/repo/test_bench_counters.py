"""The benchmark's exact counters (``benchmarks/counters.py``) against known cases, and its time verdict."""

from __future__ import annotations

import torch

from benchmarks.counters import HostSyncs, LiveBytes, count_flops


def test_matmul_flops_are_two_m_n_k() -> None:
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    flops, out = count_flops(lambda: a @ b)
    assert flops == 2 * 6 * 7 * 5
    assert out.shape == (6, 7)


def test_matmul_backward_flops_are_two_more_matmuls() -> None:
    a = torch.randn(6, 5, requires_grad=True)
    b = torch.randn(5, 7, requires_grad=True)
    flops, _ = count_flops(lambda: (a @ b).sum().backward())
    assert flops == 3 * (2 * 6 * 7 * 5)


def test_tensor_freed_inside_counts_at_peak_and_not_after() -> None:
    with LiveBytes() as live:
        t = torch.empty(1000, dtype=torch.float32)
        t.add_(1.0)  # in place: same storage, not a second allocation
        view = t[10:20]  # a view shares the storage
        del t, view
        kept = torch.zeros(10, dtype=torch.float64)
    assert live.peak == 4000
    assert live.live == 80
    del kept


def test_two_live_tensors_add_up_at_peak() -> None:
    with LiveBytes() as live:
        a = torch.ones(256)
        b = torch.ones(512)
        del a, b
        c = torch.ones(128)
    assert live.peak == (256 + 512) * 4
    assert live.live == 128 * 4
    del c


def test_storages_from_before_the_mode_are_not_counted() -> None:
    weight = torch.randn(100, 100)
    weight.grad = torch.zeros(100, 100)
    with LiveBytes() as live:
        weight.mul_(2.0)  # in place on a parameter
        weight.grad.add_(weight)  # accumulating into an existing gradient
        alias = weight.view(-1)
        del alias
    assert live.peak == 0
    assert live.live == 0


def test_backward_counts_gradients_and_saved_tensors() -> None:
    weight = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(16, 64)
    with LiveBytes() as live:
        (x @ weight).square().sum().backward()
    # the gradient of the weight (64 * 32 fp32) stays alive after the call
    assert live.live >= 64 * 32 * 4
    assert live.peak >= live.live + 16 * 32 * 4  # the product was alive during the call


def test_item_counts_one_sync() -> None:
    t = torch.randn(3)
    with HostSyncs() as syncs:
        t.sum().item()
    assert syncs.count == 1


def test_bool_and_nonzero_count_as_syncs_and_plain_math_does_not() -> None:
    t = torch.randn(8)
    with HostSyncs() as syncs:
        u = (t * 2).exp().sum()
    assert syncs.count == 0
    with HostSyncs() as syncs:
        if bool(u > 0):
            torch.nonzero(t > 0)
    assert syncs.count == 2, dict(syncs.by_op)


def test_time_verdict_reads_within_noise_when_the_round_ratios_straddle_the_goal() -> None:
    from benchmarks.verdicts import MET, MISSED, NOISE, time_ratio, time_verdict

    stock = [1.0, 1.0, 1.0, 1.0, 1.0]
    assert time_verdict(time_ratio([0.9, 0.8, 0.95, 0.9, 1.0], stock)) == MET
    assert time_verdict(time_ratio([1.1, 1.2, 1.3, 1.05, 1.4], stock)) == MISSED
    assert time_verdict(time_ratio([0.9, 1.1, 0.95, 1.0, 0.97], stock)) == NOISE
    ratio = time_ratio([2.0, 3.0, 1.0], [1.0, 2.0, 1.0])  # paired round by round, not medians divided
    assert ratio == {"median": 1.5, "min": 1.0, "max": 2.0, "rounds": 3}


def test_in_place_addmm_counts_its_product() -> None:
    from benchmarks.counters import count_flops

    a, b, acc = torch.randn(8, 16), torch.randn(16, 4), torch.zeros(8, 4)
    flops, _ = count_flops(lambda: acc.addmm_(a, b))
    assert flops == 2 * 8 * 16 * 4
    batched = torch.zeros(3, 8, 4)
    flops, _ = count_flops(lambda: batched.baddbmm_(a.expand(3, 8, 16), b.expand(3, 16, 4)))
    assert flops == 3 * 2 * 8 * 16 * 4


def test_cpu_attention_counts_torchs_sdpa_formula_forward_and_backward() -> None:
    import torch.nn.functional as F

    from benchmarks.counters import count_flops

    b, heads, s, d = 1, 2, 16, 8
    q = torch.randn(b, heads, s, d, requires_grad=True)
    forward, _ = count_flops(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert forward == 2 * (2 * b * heads * s * s * d)  # q @ k^T and p @ v, full s x s
    total, _ = count_flops(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward())
    assert total == forward + 5 * (2 * b * heads * s * s * d)  # torch's backward: five products of that size


def test_host_to_device_counts_tensors_made_from_host_data_only() -> None:
    from benchmarks.counters import HostToDevice

    x = torch.ones(4)
    with HostToDevice() as h2d:
        # Python numbers as kernel arguments, a device scalar made by a fill kernel: not counted
        _ = x * 0.5 + torch.full((4,), 2.0) + torch.scalar_tensor(3.0) + x.clamp(min=1)
    assert h2d.count == 0, dict(h2d.by_op)
    with HostToDevice() as h2d:
        torch.tensor([1.0, 2.0])
        x.new_tensor(x.numel())
        torch.as_tensor(0.5, dtype=torch.float32)
    assert dict(h2d.by_op) == {"aten::lift_fresh": 3}


def test_check_fails_on_a_missed_exact_goal_or_a_skipped_variant_but_not_on_verl() -> None:
    from benchmarks.run import failed_checks

    ok = {"flops_ok": True, "detach_flops_ok": True, "inference_ok": True, "syncs_ok": True, "h2d_ok": True, "memory_ok": False}
    result = {"points": {"V8-s4-N1": {"goals": dict(ok)}}, "refused": {"verl": "verl 0.9.1 is not importable"}}
    assert failed_checks(result) == []  # memory is not checked, verl may be missing
    result["points"]["V8-s4-N1"]["goals"]["syncs_ok"] = False
    result["refused"]["hooks_dense"] = "refused"
    assert failed_checks(result) == ["V8-s4-N1: syncs missed", "variant hooks_dense skipped: refused"]


def test_smoke_shapes_report_the_memory_goal_as_not_measured_not_missed() -> None:
    from benchmarks.configs import CONFIGS
    from benchmarks.verdicts import MISSED, UNJUDGED, goals_at, memory_verdict

    def counts(peak: int) -> dict:
        return {"train": {"flops": 8, "peak_bytes": peak, "h2d": 0, "syncs": 0}, "infer": {"h2d": 0, "syncs": 0},
                "train_cpu_s": [1.0], "train_s": [1.0]}

    variants = {"stock": counts(100), "hooks_lean": counts(100)}  # lean's peak above the target: missed where judged
    shape = CONFIGS["smoke"].base
    assert memory_verdict(goals_at(shape, variants)) == MISSED
    assert memory_verdict(goals_at(shape, variants, memory_goal=CONFIGS["smoke"].memory_goal)) == UNJUDGED
    assert CONFIGS["cpu"].memory_goal and CONFIGS["gpu"].memory_goal


def test_time_verdict_straddling_the_threshold_reads_inconclusive() -> None:
    from benchmarks.verdicts import NOISE, time_ratio, time_verdict

    assert NOISE == "inconclusive"
    assert time_verdict(time_ratio([0.9, 1.1, 1.0], [1.0, 1.0, 1.0])) == "inconclusive"


def test_host_reads_see_tolist_and_scalar_conversions_that_dispatch_nothing_on_cpu() -> None:
    from benchmarks.counters import HostReads

    t = torch.arange(4)
    with HostReads() as reads, HostSyncs() as syncs:
        t.tolist()
        int(t[1])
        _ = t * 2 + t.sum()  # device math: no read
    assert dict(reads.by_op) == {"tolist": 1, "int": 1}
    assert syncs.count == 1  # the dispatch counter sees int()'s _local_scalar_dense, not tolist

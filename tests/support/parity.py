"""The parity matrix: one case is a point in the product of the knobs, run against a stock twin.

Test-only support for ``tests/parity/test_parity_matrix.py``, on the pieces of the side-by-side
harness ``mtp_hooks.testing.twins`` (batches, the output-layer recorder, mcore's tracker, the hooks'
per-depth losses). What is the matrix's own: a ``Case`` names one value per knob (output mode, loss
path, tied head, gradient-accumulation fusion under mcore's DDP, dtype, detach flags, per-token
loss, checkpoint recompute, micro-batches in flight, the draft chain (and its engine geometry), the acceptance rule measured
(``parity_acceptance``), parallel layout). ``run_case`` builds the twins with the same weights
(rounded to the case's dtype, wrapped as the case says), runs the same micro-batches through both in
the schedule's order and compares:

* stock is called with ``labels`` and returns its per-token loss; its main logits are recorded
  (``output_layer_calls``: the last call of a training forward is the main head) with their
  graph, so a user loss on them backpropagates through stock;
* the user loss: ``output="logits"``: the masked CE (stock: its own per-token loss; hooked: mcore's
  vocab-parallel CE of the returned logits); ``output="logprobs"``: a policy-gradient loss with an
  entropy bonus, from the hooked ``TokenLogProbs`` and, for stock, from ``log_softmax`` of its
  logits / temperature at the labels (and their entropy);
* compared: the main output (logits bit for bit; log-probs and entropy), the per-depth MTP losses
  of every micro-batch (``hooks.metrics()`` and the tracker the hooks fill, against stock's tracker
  read right after its forward, before a recompute could add to it), with an ``accept`` value the
  acceptance metrics against a dense reference from stock's captured logits, and every parameter's
  ``grad`` (``main_grad`` under fusion; which parameters got none must agree too).

Tolerances: fp32: near-bitwise (``FP32``, the side-by-side suite's). bf16 / fp16: the twins also
run against an fp32 stock twin holding the same (rounded) weights; for every compared tensor the
hooked error against it must stay within stock's own error against it (``within_stock_error``).

Where stock has no reference for a knob (``detach_*``), the stock twin gets the knob's definition
applied with plain autograd by pre-hooks (``stock_references``); ``Case.reference`` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import traceback
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

import mtp_hooks
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from mtp_hooks.testing import Batch, TinyGPT, context_parallel_positions, fused_wgrad_kernel_on_cpu, hooked_mtp_losses, make_batch
from mtp_hooks.testing import output_layer_calls, stock_mtp_losses, tracked_mtp_losses
from tests.support.stock_engine_geometry import stock_engine_steps
from tests.support.stock_references import CHAIN, DEPTH, DETACH_OPTIONS, ENGINE, PRE_NORM, STEP_WEIGHTS, UNNORMED, ZEROED, gather_vocab, stock_chain, stock_detaches, step_weights
from tests.support.parity_acceptance import ACCEPT, FORBIDDEN_ACCEPT, accept_options, accept_reference, hooked_acceptance, stock_acceptance

VOCAB = 64
SEED = 1234
FP32 = dict(atol=1e-6, rtol=1e-5)
TEMPERATURE = 0.7
ENTROPY_WEIGHT = 0.05

# The knobs and their values, in the order of a case id.
AXES: dict[str, tuple[Any, ...]] = {
    "output": ("logits", "logprobs", "logprobs_entropy", "logprobs_entropy_t0.7"),
    "loss_impl": ("lean", "fused", "recompute", "dense"),
    "tied": (False, True),
    "fusion": (False, True),
    "dtype": ("fp32", "bf16", "fp16"),
    "detach": ("none", "encoder", "head", "both", "between"),
    "per_token": (False, True),
    "checkpoint": (False, True),
    "micro_batches": ("1", "2", "2_reversed"),
    "chain": ("none", "k2_argmax", "k3", "k4_argmax", "first_k2", "first_k3_argmax", "weighted", "k3_argmax_decay", "pre_norm",
              "first_k2_argmax_pre_norm", "cyclic_k3_argmax", "k3_unnormed", *ENGINE, *ZEROED),
    "accept": tuple(ACCEPT),
}
# The value pairs no case can have, left out of the covering sets: an acceptance rule with the dense loss path
# (``parity_acceptance``), and the engine geometry with CP (its stock reference joins steps along the sequence, which
# CP splits; CP is held out against the whole sequence in ``tests/distributed/test_engine_geometry_parallel.py``).
FORBIDDEN = FORBIDDEN_ACCEPT | frozenset((("layout", "cp"), ("chain", value)) for value in ENGINE)
LAYOUTS = ("tp", "sp", "cp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The loss scaler's value per dtype (fp16 needs one; the others run at 1).
GRAD_SCALE = {"fp32": 1.0, "bf16": 1.0, "fp16": 2.0**12}


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of the product of the knobs (see ``AXES``); ``layout`` ``None`` is one process."""

    output: str = "logits"
    loss_impl: str = "lean"
    tied: bool = False
    fusion: bool = False
    dtype: str = "fp32"
    detach: str = "none"
    per_token: bool = False
    checkpoint: bool = False
    micro_batches: str = "1"
    chain: str = "none"
    accept: str = "off"
    layout: Optional[str] = None

    @property
    def id(self) -> str:
        """``logprobs_entropy-fused-untied-fusion-bf16[-detach_encoder][-per_token][-checkpoint][-2mb][-tp]``."""
        parts = [self.output, self.loss_impl, "tied" if self.tied else "untied", "fusion" if self.fusion else "nofusion", self.dtype]
        if self.detach != "none":
            parts.append(f"detach_{self.detach}")
        if self.per_token:
            parts.append("per_token")
        if self.checkpoint:
            parts.append("checkpoint")
        if self.micro_batches != "1":
            parts.append({"2": "2mb", "2_reversed": "2mb_reversed"}[self.micro_batches])
        if self.chain != "none":
            parts.append(f"chain_{self.chain}")
        if self.accept != "off":
            parts.append(f"accept_{self.accept}")
        if self.layout is not None:
            parts.append(self.layout)
        return "-".join(parts)

    @property
    def options(self) -> dict[str, Any]:
        """The ``mtp_hooks.attach`` options of the hooked twin."""
        options: dict[str, Any] = {"loss_impl": self.loss_impl, **DETACH_OPTIONS[self.detach]}
        if self.output != "logits":
            options.update(output="logprobs", entropy="entropy" in self.output)
            if self.output.endswith("_t0.7"):
                options["temperature"] = TEMPERATURE
        steps, inputs, draft_layers = CHAIN[self.chain]
        if steps is not None:
            options.update(draft_steps=steps, draft_inputs=inputs, draft_layers=draft_layers)
        if self.chain in STEP_WEIGHTS:
            options.update(draft_step_weights=STEP_WEIGHTS[self.chain])
        if self.chain in PRE_NORM:
            options.update(mtp_input="pre_final_norm")
        if self.chain in ENGINE:
            options.update(draft_geometry="engine")
        if self.chain in UNNORMED:
            options.update(draft_recycle="unnormed")
        if self.chain in ZEROED:
            options.update(start_embedding="zeroed")
        options.update(accept_options(self.accept))
        return options

    @property
    def steps(self) -> int:
        """Draft steps trained: the twins' N = 2 layers, or the chain's k."""
        return CHAIN[self.chain][0] or DEPTH

    @property
    def temperature(self) -> float:
        return TEMPERATURE if self.output.endswith("_t0.7") else 1.0

    @property
    def reference(self) -> str:
        """What the hooked twin is compared with, in words (in every failure message)."""
        parts = ["stock mcore (labels in, per-token loss out), same weights and batches"]
        flags = DETACH_OPTIONS[self.detach]
        if flags:
            what = []
            if "detach_encoder" in flags:
                what.append("every MTP layer's embedding output and the depth-0 hidden states detached")
            if "detach_between_depths" in flags:
                what.append("every later depth's input hidden states detached")
            if "detach_head" in flags:
                what.append("the MTP heads' output weight detached (0.19's mtp_detach_heads)")
            parts.append(f"stock has no {', '.join(flags)}: its twin gets the definition by pre-hooks ({'; '.join(what)})")
        if self.output != "logits":
            parts.append(f"log-probs: log_softmax(stock logits / {self.temperature}) at the labels" + (" and their entropy" if "entropy" in self.output else ""))
        steps, inputs, draft_layers = CHAIN[self.chain]
        if self.chain in PRE_NORM:
            parts.append("MTP layer 1's first call per forward reads the decoder's final norm input (a stock pre-hook)")
        if self.chain in UNNORMED:
            parts.append("every later step reads the previous step's output before the MTP layer's final norm (stock pre-hooks)")
        if self.chain in ZEROED:
            parts.append("MTP layer 1's first call per forward embeds zeros where its position_ids are 0 (a stock pre-hook)")
        if self.chain in STEP_WEIGHTS:
            parts.append(f"step weights {step_weights(self.chain)}: stock's i-th MTPLossAutoScaler.apply of a forward hangs w_i x its loss")
        if self.chain in ENGINE:
            parts.append(
                f"the engine geometry on stock: mcore's own {steps}-depth MTP loss, the block's layer-2 output dropped, step j "
                "a call of layer 1 over steps 1..j's inputs joined (j x s tokens) with a mask where step i at p sees step 1 "
                "at <= p and steps 2..i at p, rotary at p + i - 1"
                + (", steps 2.. embedding the argmax of the full (gathered) logits of the previous step's output" if inputs == "argmax" else "")
            )
        elif steps is not None and draft_layers == "first":
            parts.append(
                f"the chain on stock: mcore's own {steps}-depth MTP loss (config.mtp_num_layers = {steps}), the block's "
                f"layer-2 output dropped, the first layer called {steps - 1} more times on the block's arguments for it"
                + (", every later step embedding the argmax of the full (gathered) logits of its input" if inputs == "argmax" else "")
            )
        elif steps is not None:
            rerun = "layers 1, 2, ... in turn" if draft_layers == "cyclic" else "the last layer"
            parts.append(
                f"the chain on stock: mcore's own {steps}-depth MTP loss (config.mtp_num_layers = {steps})"
                + (f", {rerun} called {steps - DEPTH} more times on the block's arguments" if steps > DEPTH else "")
                + (", every later layer call embedding the argmax of the full (gathered) logits of its input" if inputs == "argmax" else "")
            )
        if self.accept != "off":
            parts.append(accept_reference(self.accept))
        if self.dtype != "fp32":
            parts.append(f"{self.dtype}: errors against an fp32 stock twin within stock's own")
        return "; ".join(parts)

    @property
    def n_micro(self) -> int:
        return int(self.micro_batches[0])

    @property
    def backward_order(self) -> list[int]:
        order = list(range(self.n_micro))
        return order[::-1] if self.micro_batches.endswith("reversed") else order


# --------------------------------------------------------------------------- covering sets


def covering(axes: Mapping[str, Sequence[Any]], strength: int = 2, forbidden: Collection[tuple[Any, ...]] = ()) -> list[dict[str, Any]]:
    """A deterministic set of rows in which every ``strength`` axes take every combination of their
    values at least once (``strength=2``: all pairs), but those holding a ``forbidden`` pair
    ``((axis, value), (axis, value))``, which no row holds.

    Greedy: each new row starts from the first still uncovered combination (axes and values in
    their given order) and gives every other axis, in order, the value that completes the most
    uncovered combinations with the values chosen so far (ties: the first value). Every row covers
    at least the combination it started from, so the loop ends.
    """
    names = list(axes)
    groups = list(itertools.combinations(names, strength))
    uncovered = {
        tuple(zip(group, values)) for group in groups for values in itertools.product(*(axes[a] for a in group))
        if allowed(dict(zip(group, values)), forbidden)
    }
    order = {(name, value): (names.index(name), list(axes[name]).index(value)) for name in names for value in axes[name]}
    rows: list[dict[str, Any]] = []
    while uncovered:
        row = dict(min(uncovered, key=lambda combination: [order[item] for item in combination]))
        for name in names:
            if name in row:
                continue

            def gain(value: Any, name: str = name) -> int:
                chosen = {**row, name: value}
                return sum(
                    tuple((a, chosen[a]) for a in group) in uncovered
                    for group in groups
                    if name in group and all(a in chosen for a in group)
                )

            choices = [value for value in axes[name] if allowed({**row, name: value}, forbidden)]
            row[name] = max(choices, key=lambda value: (gain(value), -list(axes[name]).index(value)))
        uncovered -= {tuple((a, row[a]) for a in group) for group in groups}
        rows.append({name: row[name] for name in names})
    return rows


def allowed(row: Mapping[str, Any], forbidden: Collection[tuple[Any, ...]]) -> bool:
    """Whether ``row`` (a case or part of one) holds no ``forbidden`` pair."""
    return not any(all(axis in row and row[axis] == value for axis, value in pair) for pair in forbidden)


def product(axes: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the first axis slowest."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def is_covering(rows: list[dict[str, Any]], axes: Mapping[str, Sequence[Any]], strength: int = 2, forbidden: Collection[tuple[Any, ...]] = ()) -> bool:
    """Whether every ``strength`` axes take every combination of their values in some row (those with a
    ``forbidden`` pair excepted, which no row may hold)."""
    seen = {tuple((a, row[a]) for a in group) for row in rows for group in itertools.combinations(axes, strength)}
    return all(allowed(row, forbidden) for row in rows) and all(
        tuple(zip(group, values)) in seen
        for group in itertools.combinations(axes, strength)
        for values in itertools.product(*(axes[a] for a in group))
        if allowed(dict(zip(group, values)), forbidden)
    )


# --------------------------------------------------------------------------- shared twin pieces


def mcore_ddp(model: nn.Module) -> DistributedDataParallel:
    """mcore's DDP around ``model`` as Megatron builds it for gradient-accumulation fusion (fp32 ``main_grad``)."""
    inner = model.module if isinstance(model, Float16Module) else model
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
    return DistributedDataParallel(inner.config, ddp_config, model)


def main_grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: param.main_grad.detach().clone() for name, param in model.named_parameters() if param.requires_grad}


def assert_same_main_grads(actual: dict[str, Tensor], expected: dict[str, Tensor], atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for name, ref in expected.items():
        torch.testing.assert_close(actual[name], ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def schedule_step(loss_of: Callable[[], Tensor], scale: float, scale_in_forward: float = 1.0) -> None:
    """One micro-batch as mcore's schedule runs it: forward (the MTP scale then still holds
    ``scale_in_forward``), then ``set_loss_scale(scale)``, then backward of ``scale * loss``."""
    MTPLossAutoScaler.set_loss_scale(torch.tensor(scale_in_forward))
    loss = loss_of()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(scale))
    (loss * scale).backward()


def relative_error(actual: Tensor, reference: Tensor) -> float:
    """Largest absolute error relative to the reference's largest entry (inf where not finite)."""
    actual, reference = actual.double(), reference.double()
    if not bool(torch.isfinite(actual).all()):
        return float("inf")
    return float((actual - reference).abs().max() / reference.abs().max().clamp(min=torch.finfo(torch.float32).tiny))


def within_stock_error(what: str, hooked: Tensor, stock: Tensor, reference: Tensor, dtype: str) -> None:
    """The hooked error against the fp32 twin is at most stock's own, doubled, plus one unit in the
    last place of 1.0 in ``dtype`` (``eps``). Both twins round the same math, in different orders,
    so stock's error is the scale of the rounding noise; the ``eps`` covers a stock error that
    happens to be tiny. On the default set the hooked / stock error ratio has median 1.0 and
    maximum 1.34 (bf16) and 2.8 (fp16 with per-token loss and a 3-step chain, at a stock error
    below one unit roundoff, where both errors are a unit or two of the last place)."""
    stock_error, hooked_error = relative_error(stock, reference), relative_error(hooked, reference)
    bound = 2 * stock_error + torch.finfo(DTYPES[dtype]).eps
    assert hooked_error <= bound, f"{what}: hooked error {hooked_error:.3g} against the fp32 twin, stock's {stock_error:.3g} (bound {bound:.3g})"


# --------------------------------------------------------------------------- the twins


@dataclasses.dataclass
class Twin:
    """One model of a case: the language model, what is called (wrappers around it), its hooks."""

    inner: nn.Module
    called: nn.Module
    hooks: Optional[mtp_hooks.MTPHooks] = None


def _shape(case: Case, dtype: str) -> TinyGPT:
    overrides: dict[str, Any] = {"calculate_per_token_loss": case.per_token}
    if case.fusion:
        overrides["gradient_accumulation_fusion"] = True
    if case.layout == "sp":
        overrides["sequence_parallel"] = True
    if dtype == "fp16":
        overrides["fp16"] = True
    position = "rope" if case.chain in ENGINE else "learned_absolute"  # the engine geometry refuses learned absolute
    return TinyGPT(vocab_size=VOCAB, tied=case.tied, params_dtype=DTYPES[dtype], position_embedding_type=position, config_overrides=overrides)


def build_twin(case: Case, dtype: str, weights: Mapping[str, Tensor], wrap: bool) -> Twin:
    """A model of ``case``'s shape in ``dtype`` holding ``weights``; ``wrap``: the case's wrappers
    (``Float16Module`` below fp32, mcore's DDP with fusion)."""
    model = _shape(case, dtype).build(SEED)
    state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    called: nn.Module = model
    if wrap and dtype != "fp32":
        called = Float16Module(model.config, model)
    if wrap and case.fusion:
        called = mcore_ddp(called)
    return Twin(model, called)


def reference_weights(case: Case) -> dict[str, Tensor]:
    """The fp32 weights of every twin, rounded to the case's dtype (so the fp32 twin holds the
    same values as the low-precision ones)."""
    model = _shape(case, "fp32").build(SEED)
    return {k: v.to(DTYPES[case.dtype]).float() if v.is_floating_point() else v for k, v in model.state_dict().items() if isinstance(v, Tensor)}


# --------------------------------------------------------------------------- one run


@dataclasses.dataclass
class Run:
    """What one twin produced: per micro-batch main output and MTP losses, and the gradients."""

    logits: list[Tensor] = dataclasses.field(default_factory=list)  # main logits, [b, s, V/tp]
    logprobs: list[Tensor] = dataclasses.field(default_factory=list)
    entropy: list[Tensor] = dataclasses.field(default_factory=list)
    mtp: list[list[float]] = dataclasses.field(default_factory=list)  # stock / hooks' tracker per micro-batch
    metrics: list[list[float]] = dataclasses.field(default_factory=list)  # hooks.metrics() per micro-batch
    acceptance: list[dict[str, float]] = dataclasses.field(default_factory=list)  # per micro-batch (``accept`` axis)
    grads: dict[str, Optional[Tensor]] = dataclasses.field(default_factory=dict)

    def record_logprobs(self, logprobs: Tensor, entropy: Optional[Tensor]) -> None:
        """Keep one micro-batch's log-probs (and entropy, where computed), detached."""
        self.logprobs.append(logprobs.detach())
        if entropy is not None:
            self.entropy.append(entropy.detach())


def case_batches(case: Case) -> list[tuple[Batch, Tensor]]:
    """The case's micro-batches (this CP rank's share with CP) and their advantages."""
    seq = 16 if case.layout == "cp" else 8
    out = []
    for index in range(case.n_micro):
        batch = make_batch(VOCAB, batch=2, seq=seq, seed=11 + index)
        advantages = torch.randn(2, seq, generator=torch.Generator().manual_seed(21 + index))
        if case.layout == "cp":
            from megatron.core import parallel_state

            keep = context_parallel_positions(seq, parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size())
            assert batch.loss_mask is not None
            batch = Batch(batch.input_ids[:, keep], batch.position_ids[:, keep], batch.labels[:, keep], batch.loss_mask[:, keep])
            advantages = advantages[:, keep]
        out.append((batch, advantages))
    return out


def _reduce(case: Case, per_token: Tensor, mask: Tensor) -> Tensor:
    """The user's reduction: masked mean, or masked sum with ``calculate_per_token_loss``."""
    total = (per_token * mask).sum()
    return total if case.per_token else total / mask.sum()


def _logprobs_loss(case: Case, logprobs: Tensor, entropy: Optional[Tensor], mask: Tensor, advantages: Tensor) -> Tensor:
    loss = _reduce(case, -advantages * logprobs, mask)
    return loss if entropy is None else loss - ENTROPY_WEIGHT * _reduce(case, entropy, mask)


def stock_logprobs(case: Case, logits: Tensor, labels: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """The reference log-probs from stock's ``[b, s, V/tp]`` logits: full-vocabulary ``log_softmax``
    of logits / temperature at the labels, and (if asked) the entropy."""
    log_p = (gather_vocab(logits).float() / case.temperature).log_softmax(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in case.output else None
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _call(case: Case, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    if case.checkpoint:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return function(*args)


def _backward(case: Case, losses: list[Tensor], grad_scale: float) -> None:
    """The schedule's order: every forward first, then the MTP scale, then the backwards (in
    ``case.backward_order``) of ``grad_scale / n * loss``; the MTP scale read in forward differs."""
    scale = grad_scale / case.n_micro
    MTPLossAutoScaler.set_loss_scale(torch.tensor(scale))
    for index in case.backward_order:
        (losses[index] * scale).backward()


def run_stock(case: Case, twin: Twin, batches: list[tuple[Batch, Tensor]], grad_scale: float) -> Run:
    """Stock's micro-batches: labels in, per-token loss and (forward hook) main logits out; the
    tracker read right after each forward; the MTP scale in forward (0.5) differs from backward's."""
    run, losses = Run(), []
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.5))
    with stock_chain(twin.inner, case.chain), stock_engine_steps(twin.inner, case.chain), stock_detaches(twin.inner, case.detach, case.steps):
        for batch, advantages in batches:

            def forward(*model_args: Any, batch: Batch = batch) -> tuple[Tensor, Tensor, Tensor]:
                # Clones, graph kept: mcore's CE then shifts the layer's own output in place.
                with output_layer_calls(twin.inner, keep_graph=True) as outputs:
                    per_token = twin.called(*model_args, labels=batch.labels, loss_mask=batch.loss_mask)
                return per_token, outputs[-1].transpose(0, 1), torch.stack([out.detach() for out in outputs[:-1]])

            stock_mtp_losses()
            per_token, logits, mtp_logits = _call(case, forward, batch.model_args)
            run.mtp.append(stock_mtp_losses())
            if case.accept != "off":
                assert batch.loss_mask is not None
                run.acceptance.append(stock_acceptance(case.accept, mtp_logits, logits.detach().transpose(0, 1), batch.loss_mask))
            run.logits.append(logits.detach().float())
            assert batch.loss_mask is not None
            if case.output == "logits":
                losses.append(_reduce(case, per_token, batch.loss_mask))
            else:
                logprobs, entropy = stock_logprobs(case, logits, batch.labels)
                run.record_logprobs(logprobs, entropy)
                losses.append(_logprobs_loss(case, logprobs, entropy, batch.loss_mask, advantages))
        _backward(case, losses, grad_scale)
    run.grads = _grads(twin, case.fusion, grad_scale)
    return run


def run_hooked(case: Case, twin: Twin, batches: list[tuple[Batch, Tensor]], grad_scale: float) -> Run:
    """The hooked twin's micro-batches, each in its ``micro_batch`` block, as ``run_stock`` runs stock's."""
    assert twin.hooks is not None
    hooks, depth = twin.hooks, twin.hooks.depth
    run, losses = Run(), []
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.5))
    for batch, advantages in batches:
        stock_mtp_losses()
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            out = _call(case, twin.called, batch.model_args)
        tracked = tracked_mtp_losses()
        run.mtp.append([] if tracked is None else tracked.tolist())
        metrics = hooks.metrics()
        run.metrics.append(hooked_mtp_losses(metrics, depth))
        if case.accept != "off":
            run.acceptance.append(hooked_acceptance(metrics))
        assert batch.loss_mask is not None
        if case.output == "logits":
            run.logits.append(out.detach().float())
            per_token = twin.inner.compute_language_model_loss(batch.labels, out.transpose(0, 1).contiguous())
            losses.append(_reduce(case, per_token, batch.loss_mask))
        else:
            # Float16Module returns every tuple as a plain tuple: read TokenLogProbs by position.
            logprobs, entropy = out
            run.record_logprobs(logprobs, entropy)
            losses.append(_logprobs_loss(case, logprobs, entropy, batch.loss_mask, advantages))
    _backward(case, losses, grad_scale)
    run.grads = _grads(twin, case.fusion, grad_scale)
    return run


def _grads(twin: Twin, fusion: bool, grad_scale: float) -> dict[str, Optional[Tensor]]:
    """Every parameter's gradient (``main_grad`` under fusion) in fp64, divided by the loss scaler's value."""
    out: dict[str, Optional[Tensor]] = {}
    for name, param in twin.inner.named_parameters():
        grad = param.main_grad if fusion else param.grad
        out[name] = None if grad is None else grad.detach().double() / grad_scale
    return out


# --------------------------------------------------------------------------- the comparison


def _is_zero(grad: Optional[Tensor]) -> bool:
    return grad is None or not bool(grad.any())


def compare(case: Case, hooked: Run, stock: Run, reference: Optional[Run]) -> None:
    """Everything ``hooked`` produced against ``stock`` (fp32) or within stock's error against
    ``reference``, the fp32 twin (bf16 / fp16)."""
    where = f"[{case.id}] reference: {case.reference}\n"
    if case.output == "logits":  # the main head is stock's own layer on the same input: bit for bit
        assert len(hooked.logits) == len(stock.logits) == case.n_micro
        for index, (ours, theirs) in enumerate(zip(hooked.logits, stock.logits)):
            assert torch.equal(ours, theirs), f"{where}micro-batch {index}: main logits differ from stock's"
    for name in ("logprobs", "entropy"):
        ours_list, theirs_list = getattr(hooked, name), getattr(stock, name)
        assert len(ours_list) == len(theirs_list), f"{where}{name}: {len(ours_list)} micro-batches, stock {len(theirs_list)}"
        for index, (ours, theirs) in enumerate(zip(ours_list, theirs_list)):
            what = f"{where}micro-batch {index}: {name}"
            if reference is None:
                torch.testing.assert_close(ours, theirs, **FP32, msg=lambda m: f"{what}: {m}")
            else:
                within_stock_error(what, ours, theirs, getattr(reference, name)[index], case.dtype)
    assert len(hooked.mtp) == len(stock.mtp) == case.n_micro
    for index in range(case.n_micro):
        expected = stock.mtp[index]
        assert len(expected) == case.steps, f"{where}micro-batch {index}: stock tracked {expected}"
        for what, ours in (("hooks.metrics()", hooked.metrics[index]), ("the hooks' tracker entries", hooked.mtp[index])):
            message = f"{where}micro-batch {index}: MTP losses, {what} {ours} vs stock's tracker {expected}"
            assert len(ours) == len(expected), message
            if reference is None:
                torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), **FP32, msg=lambda m: f"{message}: {m}")
            else:
                for k in range(len(expected)):
                    within_stock_error(f"{message}, depth {k + 1}", torch.tensor(ours[k]), torch.tensor(expected[k]), torch.tensor(reference.mtp[index][k]), case.dtype)
    assert len(hooked.acceptance) == len(stock.acceptance) == (case.n_micro if case.accept != "off" else 0), f"{where}acceptance metrics"
    for index, (ours, theirs) in enumerate(zip(hooked.acceptance, stock.acceptance)):
        message = f"{where}micro-batch {index}: acceptance metrics {ours} vs {theirs}"
        assert ours.keys() == theirs.keys(), message
        for key, value in theirs.items():
            if reference is None:
                torch.testing.assert_close(torch.tensor(ours[key]), torch.tensor(value), **FP32, msg=lambda m: f"{message}: {key}: {m}")
            else:
                within_stock_error(f"{message}: {key}", torch.tensor(ours[key]), torch.tensor(value), torch.tensor(reference.acceptance[index][key]), case.dtype)
    assert hooked.grads.keys() == stock.grads.keys()
    failures = []
    for name, theirs in stock.grads.items():
        ours = hooked.grads[name]
        if _is_zero(theirs) or _is_zero(ours):
            if not (_is_zero(theirs) and _is_zero(ours)):
                failures.append(f"{name}: {'hooked' if _is_zero(ours) else 'stock'} got no gradient, the other did")
            continue
        try:
            if reference is None:
                torch.testing.assert_close(ours, theirs, **FP32)
            else:
                ref = reference.grads[name]
                assert ref is not None, "the fp32 twin got no gradient"
                within_stock_error("gradient", ours, theirs, ref, case.dtype)
        except AssertionError as error:
            lines = [line for line in str(error).splitlines() if line.strip()]
            failures.append(f"{name}: {lines[0]}" + (f" {lines[-1]}" if len(lines) > 1 else ""))
    grad_kind = "main_grad" if case.fusion else "grad"
    assert not failures, f"{where}{grad_kind} differs:\n  " + "\n  ".join(failures)
    head = "embedding.word_embeddings.weight" if case.tied else "output_layer.weight"
    assert not _is_zero(stock.grads[head]) and any(not _is_zero(g) for n, g in stock.grads.items() if n.startswith("mtp.")), (
        f"{where}stock's head or MTP layers got no {grad_kind}: the comparison would prove nothing"
    )


def run_twins(
    case: Case, stock_only: bool = False, hooked_options: Optional[Mapping[str, Any]] = None
) -> tuple[Optional[Run], Run, Optional[Run]]:
    """Build the case's twins (and the fp32 twin below fp32) and run them: ``(hooked, stock, fp32 twin)``;
    ``stock_only`` skips the hooked twin (``None``); ``hooked_options`` add to (or override) the
    case's own attach options (the harness's self-tests)."""
    fusion = fused_wgrad_kernel_on_cpu() if case.fusion else contextlib.nullcontext()
    with fusion:
        weights = reference_weights(case)
        batches = case_batches(case)
        grad_scale = GRAD_SCALE[case.dtype]
        reference = None
        if case.dtype != "fp32":
            fp32_case = dataclasses.replace(case, dtype="fp32", fusion=False)
            reference = run_stock(fp32_case, build_twin(fp32_case, "fp32", weights, wrap=False), batches, 1.0)
        stock = run_stock(case, build_twin(case, case.dtype, weights, wrap=True), batches, grad_scale)
        if stock_only:
            return None, stock, reference
        twin = build_twin(case, case.dtype, weights, wrap=True)
        twin.hooks = mtp_hooks.attach(twin.called, **{**case.options, **(hooked_options or {})})
        hooked = run_hooked(case, twin, batches, grad_scale)
    return hooked, stock, reference


def run_case(case: Case) -> None:
    """Run the case's twins and compare them; raises ``AssertionError`` on a difference."""
    hooked, stock, reference = run_twins(case)
    assert hooked is not None
    compare(case, hooked, stock, reference)


def scenario_case(case: Case) -> Optional[str]:
    """``run_case`` on every rank of a ``tests.support.distributed.SpawnedGroup`` (each rank compares its own
    shards); a difference or an error comes back as its message, so the group serves the next case.
    The twins run the same ops on both ranks, so an error stops both at the same point; one that
    stopped a single rank inside a collective leaves the other waiting, and the group's timeout
    fails the case."""
    try:
        run_case(case)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        return traceback.format_exc(limit=-4)
    return None

"""Quickstart: attach mtp_hooks to a Megatron-Core GPTModel with MTP layers.

    python examples/quickstart.py        # after `make venv`: .venv/bin/python examples/quickstart.py

Builds a tiny GPTModel with two MTP layers (on the GPU if one is visible, else on the CPU in a few
seconds), attaches the hooks, runs one training micro-batch (the model returns the main head's
logits, the MTP layers train in the same forward), one inference micro-batch (no MTP work at all),
prints the MTP metrics (with ``agreement_metrics=True`` also the draft's expected acceptance) and
removes the hooks.
"""

from __future__ import annotations

import warnings

# mcore's own notices about optional fused kernels (Transformer Engine, Apex) and its config defaults
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import mtp_hooks  # noqa: E402
from mtp_hooks.testing import cpu_safe_config, local_layer_spec, runtime  # noqa: E402  (only the CPU needs more than stock mcore)

VOCAB = 128
SEQ = 16
BATCH = 2


def tiny_gpt_with_mtp(device: torch.device, mtp_layers: int = 2) -> GPTModel:
    """A stock mcore GPTModel: 2 decoder layers, ``mtp_layers`` MTP layers, RoPE, untied head."""
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        mtp_num_layers=mtp_layers,
        mtp_loss_scaling_factor=0.3,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # fused kernels need Transformer Engine / Apex / CUDA; the tiny model does without them
        **cpu_safe_config(),
    )
    spec = local_layer_spec(device)  # mcore's local spec; on the CPU with an SDPA core attention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )
    return model.to(device)


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """``[b, s]`` log-probability of each label under ``[b, s, V]`` logits (TP = 1: the full vocabulary)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{name}={float(value):.4g}" for name, value in metrics.items()) or "(none)"


def acceptance_problems(metrics: dict[str, float], depths: int) -> list[str]:
    """What is off in the acceptance metrics of ``agreement_metrics=True``: per depth ``mtp_k/agree`` and
    ``mtp_k/accept`` are shares in [0, 1], ``mtp/accept_len`` (accepted draft tokens) is in [0, depths]."""
    bounds = {f"mtp_{k}/{name}": 1.0 for k in range(1, depths + 1) for name in ("agree", "accept")}
    bounds["mtp/accept_len"] = float(depths)
    return [f"{name}={metrics.get(name)}, expected in [0, {bound:g}]" for name, bound in bounds.items()
            if not 0.0 <= metrics.get(name, float("nan")) <= bound]  # missing, NaN or inf fails too


def main() -> None:
    with runtime() as device:
        model = tiny_gpt_with_mtp(device)
        # agreement_metrics: also measure the draft's acceptance (mtp_k/agree, mtp_k/accept, mtp/accept_len)
        hooks = mtp_hooks.attach(model, detach_encoder=True, detach_head=True, agreement_metrics=True)

        input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        position_ids = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
        labels = torch.roll(input_ids, -1, dims=1)  # next-token labels, as for stock mcore
        loss_mask = torch.ones(BATCH, SEQ, device=device)
        loss_mask[:, -1] = 0  # the last position has no next token

        # Training micro-batch: the model returns logits; MTP losses are attached to backward.
        # Outside mcore's schedules, set the MTP gradient scale to match the main loss's scaling.
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
        with hooks.micro_batch(labels=labels, loss_mask=loss_mask):
            logits = model(input_ids, position_ids, None)
        main_loss = -(token_logprobs(logits, labels) * loss_mask).sum() / loss_mask.sum()
        main_loss.backward()  # main-loss and MTP gradients in one backward
        mtp_params = [p for name, p in model.named_parameters() if name.startswith("mtp.")]
        mtp_grads = sum(1 for p in mtp_params if p.grad is not None)
        print(f"training micro-batch:  logits {list(logits.shape)}, main loss {main_loss.item():.4f}, "
              f"{mtp_grads} MTP parameters got gradients")
        trained = hooks.metrics()
        print(f"MTP metrics: {format_metrics(trained)}")
        problems = []
        if list(logits.shape) != [BATCH, SEQ, VOCAB]:
            problems.append(f"training logits {list(logits.shape)}, expected {[BATCH, SEQ, VOCAB]}")
        if not mtp_params or any(p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.any() for p in mtp_params):
            problems.append(f"{mtp_grads} of {len(mtp_params)} MTP parameters got a gradient (all, finite and non-zero, expected)")
        for k in range(1, model.config.mtp_num_layers + 1):
            if not (trained.get(f"mtp_{k}/tokens", 0) > 0 and torch.isfinite(torch.tensor(float(trained[f"mtp_{k}/loss"])))):
                problems.append(f"no finite mtp_{k} metrics: {trained}")
        problems += acceptance_problems(trained, depths=model.config.mtp_num_layers)

        # Inference micro-batch (old-policy or reference log-probs): the MTP block does not run.
        with torch.no_grad():
            logits = model(input_ids, position_ids, None)
        inference = hooks.metrics()
        print(f"inference micro-batch: logits {list(logits.shape)}, "
              f"MTP metrics since the training micro-batch: {format_metrics(inference)}")
        if list(logits.shape) != [BATCH, SEQ, VOCAB] or inference:
            problems.append(f"inference micro-batch: logits {list(logits.shape)}, MTP metrics {inference} (expected none)")

        hooks.remove()  # the model is stock mcore again
        print("hooks removed")
        with torch.no_grad():  # stock mcore again: called with labels, it returns the main head's per-token loss
            stock_loss = model(input_ids, position_ids, None, labels=labels, loss_mask=loss_mask)
        expected_loss = -token_logprobs(logits, labels)
        if mtp_hooks.hooks_of(model) is not None or stock_loss.shape != expected_loss.shape or not torch.allclose(
                stock_loss.float(), expected_loss, rtol=1e-4, atol=1e-4):
            problems.append("after remove() the model is not stock: hooks still attached, or its per-token loss "
                            "differs from the cross-entropy of the hooked inference logits")
        if problems:
            print("verdict: NOT as expected: " + "; ".join(problems))
            raise SystemExit(1)
        print("verdict: logits, MTP gradients and acceptance metrics as expected, hooks removed cleanly")


if __name__ == "__main__":
    main()

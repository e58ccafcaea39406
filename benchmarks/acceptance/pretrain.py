"""Pretraining of the acceptance benchmark's model, and its cache: one model per task, sizes and seed.

Joint main + MTP training as stock mcore trains (MTP gradients reach the trunk). The pretrained
state dict and its record are saved under the cache folder (``bench-out/acceptance-cache/``) for a
task that names a cache key (the code task: corpus + vocabulary), keyed also by every
pretraining field of the setting, the seed and the torch and megatron-core versions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mtp_hooks
from benchmarks.acceptance.settings import Setting, build_model
from benchmarks.acceptance.drafts import device_of, positions
from benchmarks.acceptance.task import Task


def forward(model: nn.Module, tokens: Tensor) -> Tensor:
    """Main-head logits of CPU token ids, on the model's device."""
    tokens = tokens.to(device_of(model))
    return model(tokens, positions(tokens), None)


@torch.no_grad()
def held_out_loss(model: nn.Module, tokens: Tensor, batch: int = 16) -> float:
    """Main-head next-token CE over a fixed held-out batch (an inference forward: MTP off)."""
    total = count = 0.0
    for rows in tokens.split(batch):
        logits = forward(model, rows)[:, :-1].float()
        total += float(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten().to(logits.device), reduction="sum"))
        count += rows[:, 1:].numel()
    return total / count


def pretrain(model: nn.Module, task: Task, setting: Setting, log: Any) -> dict[str, Any]:
    """Joint main + MTP training (MTP gradients reach the trunk, as stock mcore trains). Stops when
    the held-out loss of one window improves by less than ``sft_tolerance`` of the last one, or,
    for a task without held-out text, when the window's mean expected acceptance improves by less
    than ``sft_tolerance``."""
    gen = torch.Generator().manual_seed(setting.seed + 1)
    device = device_of(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=setting.sft_lr)
    held = task.held_out()
    history: list[list[float]] = []
    windows: list[float] = []
    losses: list[float] = []
    flat = False
    # accept_rule="sampled": the benchmark's speculative loop samples its drafts (drafts.py, mtp_hooks.testing.speculative).
    with mtp_hooks.attached(model, agreement_metrics=True, accept_rule="sampled") as hooks:
        for step in range(1, setting.sft_max_steps + 1):
            tokens = task.pretrain_batch(setting.sft_batch, setting.pretrain_seq, gen)
            labels = torch.roll(tokens, -1, 1)
            labels[:, -1] = 0
            mask = torch.ones_like(tokens, dtype=torch.float32)
            mask[:, -1] = 0
            tokens, labels, mask = tokens.to(device), labels.to(device), mask.to(device)
            with hooks.micro_batch(labels=labels, loss_mask=mask):
                logits = model(tokens, positions(tokens), None)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
            ((loss * mask.flatten()).sum() / mask.sum()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            metrics = hooks.metrics()
            history.append([metrics[f"mtp_{k}/accept"] for k in range(1, setting.mtp + 1)])
            if step % setting.sft_window == 0:
                windows.append(sum(map(sum, history[-setting.sft_window :])) / (setting.sft_window * setting.mtp))
                if held is None:
                    log(f"  pretrain step {step:>5}: main CE {float(loss.detach().mean()):.3f}, window mean acceptance {windows[-1]:.3f}")
                    flat = len(windows) >= 2 and windows[-1] - windows[-2] < setting.sft_tolerance
                else:
                    losses.append(held_out_loss(model, held))
                    log(f"  pretrain step {step:>5}: main CE {float(loss.detach().mean()):.3f}, held-out CE {losses[-1]:.3f}, "
                        f"window mean acceptance {windows[-1]:.3f}")
                    flat = len(losses) >= 2 and losses[-2] - losses[-1] < setting.sft_tolerance * losses[-2]
                if step >= setting.sft_min_steps and flat:
                    break
    out: dict[str, Any] = {"steps": step, "plateau": flat, "window_accept": windows}
    if held is not None:
        out["held_out_loss"] = losses
    return out


_PRETRAINED: dict[str, tuple[dict[str, Tensor], dict[str, Any]]] = {}


def _pretrain_key(task: Task, setting: Setting) -> Optional[str]:
    base = task.cache_key()
    if base is None:
        return None
    from importlib.metadata import version

    fields = {k: v for k, v in dataclasses.asdict(setting).items()
              if k.startswith("sft_") or k in ("hidden", "layers", "heads", "vocab", "mtp", "seq", "position_embedding", "held_out_windows", "seed")}
    if setting.family != "gpt":  # the GPT family's keys as they were before families
        fields["family"] = setting.family
    text = json.dumps([base, fields, version("megatron-core"), torch.__version__], sort_keys=True)
    return f"{base}-seed{setting.seed}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def pretrained(task: Task, setting: Setting, cache: Path, log: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The pretrained state dict of this seed and its pretraining record; from ``cache`` if there."""
    key = _pretrain_key(task, setting)
    path = cache / f"pretrained-{key}.pt"
    if key is not None and key in _PRETRAINED:
        return _PRETRAINED[key]
    if key is not None and path.exists():
        saved = torch.load(path, map_location=setting.device, weights_only=False)
        log(f"pretrained model of seed {setting.seed} from {path} ({saved['pretrain']['steps']} steps)")
        _PRETRAINED[key] = (saved["state"], {**saved["pretrain"], "cached": True})
        return _PRETRAINED[key]
    base = build_model(setting, seed=1234 + setting.seed)
    log(f"pretraining (joint main + MTP, stock-style) on the {task.name} task, batch {setting.sft_batch} x {setting.pretrain_seq}")
    started = time.perf_counter()
    sft = pretrain(base, task, setting, log)
    sft["seconds"] = time.perf_counter() - started
    state = {k: v.clone() if isinstance(v, Tensor) else v for k, v in base.state_dict().items()}
    if key is not None:
        cache.mkdir(parents=True, exist_ok=True)
        torch.save({"state": state, "pretrain": sft}, path)
        _PRETRAINED[key] = (state, sft)
    return state, sft



"""HF folders an engine loads: ``config.json``, the weights as safetensors, the tokenizer.

``save_hf_folder(folder, model, family)`` writes the whole model (``hf_weights``) with its derived
config (``hf_config``); ``write_hf_folder(folder, pairs, config)`` writes pairs you already have
(a bridge's main-model pairs with ``mtp_hf_weights``, say). ``vllm.LLM(model=folder)`` and
``mtp_hooks.engine.start_vllm(folder, k)`` load the folder; transformers' ``from_pretrained``
reads the same files.

The weights go in ``dtype`` (the one ``config.json`` names), one ``model.safetensors`` up to
``max_shard_bytes``, else ``model-0000i-of-0000n.safetensors`` shards with
``model.safetensors.index.json``, written as the pairs come: at most one shard is held in memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from mtp_hooks.errors import MTPHooksError, bad_argument, describe
from mtp_hooks.export.families import FAMILIES, hf_config
from mtp_hooks.export.weights import Model
from mtp_hooks.export.whole import hf_weights

__all__ = ["save_hf_folder", "write_hf_folder"]

SHARD_BYTES = 5 * 2**30  # transformers' default shard size


def _dtype_name(dtype: Union[torch.dtype, str]) -> str:
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
        expected = "a floating torch.dtype (torch.bfloat16, torch.float16, torch.float32) or its name"
        raise bad_argument("dtype", expected, describe(dtype))
    return name


def _checked_config(config: Any, dtype: str) -> dict[str, Any]:
    if not isinstance(config, Mapping) or not config.get("architectures"):
        expected = "a config.json dict with architectures (hf_config(model, family) gives one)"
        raise bad_argument("config", expected, describe(config))
    found = dict(config)
    declared = found.get("dtype", found.get("torch_dtype"))
    if declared is not None and str(declared).removeprefix("torch.") != dtype:
        raise bad_argument("config", f"dtype {dtype!r}, the dtype the weights are written in", f"dtype {declared!r}")
    if declared is None:
        found["dtype"] = dtype
    return found


def _check_tokenizer(tokenizer: Any) -> None:
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        expected = "None or a tokenizer with save_pretrained(folder) (a transformers tokenizer)"
        raise bad_argument("tokenizer", expected, describe(tokenizer))


def _check_shard_bytes(max_shard_bytes: Any) -> None:
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise bad_argument("max_shard_bytes", "an int >= 1", describe(max_shard_bytes))


def write_hf_folder(
    folder: Union[str, Path], pairs: Iterable[tuple[str, Tensor]], config: Mapping[str, Any], *, tokenizer: Any = None,
    dtype: Union[torch.dtype, str] = torch.bfloat16, max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write ``pairs`` as an HF folder: safetensors in ``dtype``, ``config.json``, the tokenizer.

    Args:
        folder: created if missing; files of the same names are replaced.
        pairs: ``(hf_name, tensor)`` pairs, each name once (e.g. ``hf_weights(model, layout)``).
        config: the ``config.json`` dict (``hf_config(model, family)``); its ``dtype`` is set to
            ``dtype`` when it names none.
        tokenizer: saved into the folder with ``save_pretrained`` (vLLM loads the tokenizer from the
            model folder unless told another); ``None`` writes none.
        dtype: the weights' dtype on disk.
        max_shard_bytes: the largest shard; one shard is ``model.safetensors``.

    Returns:
        ``folder`` as a ``Path``.

    Raises:
        MTPHooksError: a config without ``architectures`` or naming another dtype, a bad ``dtype``,
            ``max_shard_bytes`` or tokenizer (before anything is written); a name given twice or a
            non-tensor, when the pairs reach it.
    """
    name = _dtype_name(dtype)
    found = _checked_config(config, name)
    _check_tokenizer(tokenizer)
    _check_shard_bytes(max_shard_bytes)
    from safetensors.torch import save_file  # transformers' and vLLM's format (a dependency of both)

    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    shards: list[list[str]] = []
    shard: dict[str, Tensor] = {}
    size = total = 0

    def flush() -> None:
        save_file(shard, str(target / f".shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        shards.append(list(shard))

    for hf_name, tensor in pairs:
        if not isinstance(tensor, Tensor):
            raise bad_argument("pairs", "(hf_name, tensor) pairs", f"{hf_name!r}: {describe(tensor)}")
        if hf_name in seen:
            raise bad_argument("pairs", "each name once", f"{hf_name!r} twice")
        seen.add(hf_name)
        value = tensor.detach().to(getattr(torch, name)).contiguous().clone()
        bytes_ = value.numel() * value.element_size()
        if shard and size + bytes_ > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[hf_name] = value
        size, total = size + bytes_, total + bytes_
    if shard or not shards:
        flush()
    _name_shards(target, shards, total)
    (target / "config.json").write_text(json.dumps(found, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(target))
    return target


def _name_shards(folder: Path, shards: list[list[str]], total: int) -> None:
    """The written shards under their HF names (and the index, for more than one)."""
    if len(shards) == 1:
        (folder / ".shard-00000.safetensors").replace(folder / "model.safetensors")
        return
    weight_map = {}
    for index, names in enumerate(shards):
        final = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f".shard-{index:05d}.safetensors").replace(folder / final)
        weight_map.update({hf_name: final for hf_name in names})
    index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))


def save_hf_folder(
    folder: Union[str, Path],
    model: Model,
    family: str,
    *,
    config: Optional[Mapping[str, Any]] = None,
    tokenizer: Any = None,
    dtype: Union[torch.dtype, str] = torch.bfloat16,
    max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write the whole mcore ``model`` (main + MTP layers) as an HF folder of ``family`` that vLLM loads.

    The weights are ``hf_weights(model, FAMILIES[family])`` (gathered over TP, EP and PP), the config
    ``hf_config(model, family, dtype=dtype, **config)``, with the tokenizer's ``bos_token_id`` and
    ``eos_token_id`` where neither the derivation nor ``config`` gives them. Collective: every rank
    of the model's groups calls it; global rank 0 writes, the others only take part in the gathering.

    Args:
        folder: the folder to write (created if missing).
        model: the mcore ``GPTModel`` with MTP layers (or a wrapper, or a stage's chunk list).
        family: ``"deepseek_v3"``, ``"glm4_moe"`` or ``"mimo"`` (``FAMILIES``).
        config: overrides of the derived ``config.json`` keys (``hf_config``'s ``overrides``).
        tokenizer: saved with ``save_pretrained``; vLLM reads the tokenizer from this folder by default.
        dtype: the weights' dtype on disk and ``config.json``'s (default bf16, what vLLM runs).
        max_shard_bytes: as for ``write_hf_folder``.

    Returns:
        ``folder`` as a ``Path`` (on every rank).

    Raises:
        MTPHooksError: before anything is gathered or written: ``hf_config``'s and ``hf_weights``'
            refusals, a bad ``config`` (one naming another dtype), ``dtype``, ``tokenizer`` or
            ``max_shard_bytes``.

    Example::

        save_hf_folder("ckpt/step-100", model, "mimo", tokenizer=tokenizer)
        llm = mtp_hooks.engine.start_vllm("ckpt/step-100", num_speculative_tokens=1)
    """
    if family not in FAMILIES:
        raise bad_argument("family", f"one of {', '.join(repr(name) for name in FAMILIES)}", describe(family))
    if config is not None and not isinstance(config, Mapping):
        raise bad_argument("config", "None or a dict of config.json keys over the derived ones", describe(config))
    _check_tokenizer(tokenizer)
    # a dtype in config goes into the derived config and is checked against ``dtype`` below
    found = hf_config(model, family, **{"dtype": _dtype_name(dtype), **dict(config or {})})
    for key in ("bos_token_id", "eos_token_id"):
        if found.get(key) is None and getattr(tokenizer, key, None) is not None:
            found[key] = getattr(tokenizer, key)
    _checked_config(found, _dtype_name(dtype))  # every rank refuses alike, before the collective gathering
    _check_shard_bytes(max_shard_bytes)
    pairs = hf_weights(model, FAMILIES[family])
    if dist.is_initialized() and dist.get_rank() != 0:
        for _ in pairs:  # the gathering is collective: take part, write nothing
            pass
        return Path(folder)
    return write_hf_folder(folder, pairs, found, tokenizer=tokenizer, dtype=dtype, max_shard_bytes=max_shard_bytes)

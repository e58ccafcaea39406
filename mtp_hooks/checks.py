"""What the hooks verify about the targets a user hands them, before a forward uses them.

Shapes, dtypes and devices are checked eagerly (no device work). Checks of tensor *values* (mask in
{0, 1}, labels inside the vocabulary) follow ``Options.validate``:

* ``"device"`` (default): no host sync. The condition is computed on the device and handed to
  ``torch._assert_async``. On CPU that raises at once and the hooks answer with a full
  ``MTPHooksError``; on a GPU it becomes a device-side assert that fails a later CUDA call (the
  message cannot travel back from the device): rerun with ``validate="host"`` to see which value.
* ``"host"``: one host sync per check, and the full ``MTPHooksError`` before anything changes.
* ``"off"``: values are not checked (stock mcore's behaviour).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, get_args

import torch
from torch import Tensor

from mtp_hooks.errors import MTPHooksError, bad_argument, describe

Validate = Literal["device", "host", "off"]
VALIDATE_MODES: tuple[str, ...] = get_args(Validate)
_SHOWN = 5  # offending entries listed in an error message


def check_targets(labels: Any, loss_mask: Any, validate: Validate) -> None:
    """Refuse labels that are not a ``[b, s]`` integer tensor, and masks not shaped like them,
    on another device, or (values, per ``validate``) not 0/1."""
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise bad_argument("labels", "a [b, s] integer tensor", describe(labels))
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise bad_argument("labels", "an integer dtype (token ids)", describe(labels))
    if loss_mask is None:
        return
    if not isinstance(loss_mask, Tensor) or loss_mask.shape != labels.shape:
        expected = f"None or a tensor shaped like labels {tuple(labels.shape)}"
        raise bad_argument("loss_mask", expected, describe(loss_mask))
    if loss_mask.device != labels.device:
        raise bad_argument(
            "loss_mask", f"a tensor on the device of labels ({labels.device})", f"a tensor on {loss_mask.device}"
        )
    if loss_mask.dtype != torch.bool and validate != "off":
        other = (loss_mask != 0) & (loss_mask != 1)
        require(~other.any(), validate, lambda: _not_binary(loss_mask, other))


def check_loss_scale(name: str, value: Any) -> Any:
    """``value`` if it is a valid MTP loss multiplier: ``None``, a float >= 0 or a 0-d floating tensor."""
    if value is None or (isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point()):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise bad_argument(
        name, "None, a float >= 0 or a 0-d floating tensor (a multiplier of the micro-batch's MTP loss)", repr(value)
    )


def check_against_inputs(labels: Tensor, input_ids: Any) -> None:
    """Targets must match the call's ``input_ids`` in shape and device (any integer dtype, as stock)."""
    if not isinstance(input_ids, Tensor):
        return
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise bad_argument("input_ids", "an integer dtype of input_ids (token ids)", describe(input_ids))
    if labels.shape != input_ids.shape:
        raise bad_argument("labels", f"shape of input_ids {tuple(input_ids.shape)}", describe(labels))
    if labels.device != input_ids.device:
        raise bad_argument(
            "labels", f"a tensor on the device of input_ids ({input_ids.device})", f"a tensor on {labels.device}"
        )


def check_label_range(labels: Tensor, loss_mask: Optional[Tensor], vocab_size: int, validate: Validate) -> None:
    """Refuse a label outside ``[0, vocab_size)`` where the mask counts it: mcore's CE would
    silently treat it as a zero logit."""
    if validate == "off":
        return
    outside = (labels < 0) | (labels >= vocab_size)
    if loss_mask is not None:
        outside &= loss_mask != 0
    require(~outside.any(), validate, lambda: _outside_vocabulary(labels, outside, loss_mask is None, vocab_size))


def require(ok: Tensor, validate: Validate, error: Callable[[], MTPHooksError]) -> None:
    """Raise ``error()`` unless the 0-dim bool ``ok`` holds, as ``validate`` says (module docstring)."""
    if validate == "off":
        return
    if validate == "host":
        if ok.device.type == "meta":
            raise bad_argument(
                "validate",
                "'host' only with targets that hold values (validate='host' reads them on the host)",
                "'host' with meta tensors, which have no values\n"
                "  fix: attach(..., validate='off') (or 'device') to trace or count a model on the meta device",
            )
        if not bool(ok):
            raise error()
        return
    try:
        torch._assert_async(ok, "mtp_hooks: invalid targets (rerun with attach(..., validate='host') for details)")
    except RuntimeError:  # raised at once on CPU tensors
        raise error() from None


def _not_binary(loss_mask: Tensor, other: Tensor) -> MTPHooksError:
    """The error for a mask with values other than 0 and 1: how many, which values where, why."""
    where = other.nonzero().tolist()
    shown = ", ".join(f"{loss_mask[b, s].item():g} at [{b}, {s}]" for b, s in where[:_SHOWN])
    more = f" and {len(where) - _SHOWN} more" if len(where) > _SHOWN else ""
    return bad_argument(
        "loss_mask",
        "values in {0, 1}: mtp_hooks reads the mask as a selection of tokens (its metrics count tokens, "
        "mtp_targets rolls it as 0/1)",
        f"{describe(loss_mask)} with {len(where)} values other than 0 and 1: {shown}{more}\n"
        "  why: stock mcore multiplies each token's CE by the mask and divides by its sum, so a weighted mask\n"
        "  would weight the MTP loss and count fractional tokens; mtp_hooks does not take weights\n"
        "  fix: pass (loss_mask > 0) to select those tokens, or validate='off' to skip this check",
    )


def _outside_vocabulary(labels: Tensor, outside: Tensor, unmasked: bool, vocab_size: int) -> MTPHooksError:
    """The error for labels outside the vocabulary: how many, which ids where, how to mask them."""
    where = outside.nonzero().tolist()
    shown = ", ".join(f"{labels[b, s].item()} at [{b}, {s}]" for b, s in where[:_SHOWN])
    more = f" and {len(where) - _SHOWN} more" if len(where) > _SHOWN else ""
    counted = "with loss_mask=None every position counts" if unmasked else "where loss_mask is 1"
    return bad_argument(
        "labels",
        f"token ids in [0, {vocab_size}) wherever the loss counts them ({counted})",
        f"{len(where)} ids outside the vocabulary: {shown}{more}\n"
        "  fix: set loss_mask to 0 at those positions (e.g. loss_mask=(labels >= 0) for -100 padding labels)",
    )

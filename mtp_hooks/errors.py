"""The exception types of ``mtp_hooks``: bad input, calls the hooks' state refuses, and a rollout engine
whose draft is not the trainer's."""

from __future__ import annotations

import threading
from typing import Any


class MTPHooksError(ValueError):
    """Raised for every bad input or unsupported combination.

    Messages name the argument, then what was expected and what came, on separate lines.
    """


class MTPHooksStateError(RuntimeError):
    """Raised for a call the hooks' state refuses, whatever its arguments: a nested forward, a
    forward or ``micro_batch`` from a second thread while one is in flight, a call on removed
    hooks, hooks whose model is gone, a copy taken mid-forward.

    Messages name the call, then what was expected and what came, on separate lines.
    """


class StaleDraftError(MTPHooksError):
    """Raised when the draft a rollout engine holds is not the one the trainer has (``mtp_hooks.engine``):
    a tensor never pushed, a push skipped after an optimizer step, or an engine tensor changed since
    the push.

    Messages name the first tensor that differs, then the trainer's and the engine's checksums on
    separate lines.
    """


def bad_argument(name: str, expected: str, received: Any) -> MTPHooksError:
    """Build an ``MTPHooksError`` for argument ``name``."""
    return MTPHooksError(f"{name}: bad value\n  expected: {expected}\n  received: {received}")


def bad_state(call: str, expected: str, received: str) -> MTPHooksStateError:
    """Build an ``MTPHooksStateError`` for ``call``."""
    return MTPHooksStateError(f"{call}: refused\n  expected: {expected}\n  received: {received}")


def other_thread(name: str, what: str) -> MTPHooksStateError:
    return bad_state(
        name,
        "one thread at a time on these hooks (attach one model per thread, or serialise the calls)",
        f"{what} from thread {threading.get_ident()} while another thread has a forward in flight",
    )


def not_entered() -> MTPHooksStateError:
    return bad_state(
        "micro_batch",
        "`with hooks.micro_batch(labels, loss_mask):` around the training forward (the block bounds the targets)",
        "micro_batch(...) called without `with`; its targets were dropped and trained nothing",
    )


def unused_targets(seen: bool) -> str:
    """The warning for a ``micro_batch`` block that ended with targets no forward used."""
    what = (
        "every forward of the model inside it ran with gradients disabled (torch.no_grad / torch.inference_mode), "
        "which makes it an inference micro-batch"
        if seen
        else "no forward of the model ran inside it on this thread"
    )
    return (
        f"mtp_hooks: a micro_batch block ended and its targets trained nothing: {what}. To train MTP on "
        "them, run the model's training forward (gradients enabled) inside the `with` block; for an "
        "inference pass on purpose, call the model outside micro_batch. (Shown once per attached model.)"
    )


def describe(value: Any) -> str:
    """Short description of a value for error messages (tensors by dtype and shape)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"tensor of dtype {dtype} and shape {tuple(shape)}"
    return repr(value)

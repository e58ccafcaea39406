"""The side-by-side harness: a stock mcore model and a hooked twin, one micro-batch, one comparison.

Stock mcore is the reference. Both twins are built from one shape and seed, so their weights are
identical (``build_twins`` checks it). On a training micro-batch:

* stock is called with ``labels`` (``stock_train_step``): it returns the per-token main loss and
  adds its MTP loss itself; its per-depth MTP losses land in mcore's tracker, and its main logits
  are recorded on the way (``output_layer_calls``, the last call of a training forward);
* the hooked twin returns logits (``hooked_train_step``, labels through ``micro_batch`` or as
  ``labels=``); the user computes the same masked-mean CE from them.

``Twins.assert_step_matches`` runs both and checks main logits (bit-identical), per-depth MTP
losses and every parameter's gradient with one call. The steps and comparisons are usable on
their own where the reference is something else (a never-hooked twin, a hooked twin without
faults, a schedule):

* ``batches``: ``Batch``, ``make_batch``, ``masked_mean``, ``main_ce_from_logits``;
* ``steps``: ``stock_train_step`` (-> ``StockRun``), ``stock_main_only_step``,
  ``hooked_forward``, ``hooked_train_step``, ``output_layer_calls``, ``tracked_mtp_losses``,
  ``stock_mtp_losses``;
* ``compare``: ``grads_of``, ``assert_same_grads``, ``hooked_mtp_losses``, ``assert_same_mtp_losses``;
* ``pair``: ``build_twins`` (-> ``Twins``), ``TwinStep``, ``ModelShape``.

Example (on CPU, after ``init_parallel()`` and inside ``cuda_current_device_is_cpu()``)::

    twins = build_twins(TinyQwen(), seed=0)
    step = twins.assert_step_matches(make_batch(vocab_size=64, seq=16))
    step.stock.mtp_losses  # stock's per-depth MTP losses, equal to the hooks'
"""

from mtp_hooks.testing.twins.batches import Batch, main_ce_from_logits, make_batch, masked_mean
from mtp_hooks.testing.twins.compare import assert_same_grads, assert_same_mtp_losses, grads_of, hooked_mtp_losses
from mtp_hooks.testing.twins.pair import ModelShape, Twins, TwinStep, build_twins
from mtp_hooks.testing.twins.steps import PATHS, StockRun, hooked_forward, hooked_train_step, output_layer_calls
from mtp_hooks.testing.twins.steps import stock_main_only_step, stock_mtp_losses, stock_train_step, tracked_mtp_losses

__all__ = [
    "PATHS",
    "Batch",
    "ModelShape",
    "StockRun",
    "TwinStep",
    "Twins",
    "assert_same_grads",
    "assert_same_mtp_losses",
    "build_twins",
    "grads_of",
    "hooked_forward",
    "hooked_mtp_losses",
    "hooked_train_step",
    "main_ce_from_logits",
    "make_batch",
    "masked_mean",
    "output_layer_calls",
    "stock_main_only_step",
    "stock_mtp_losses",
    "stock_train_step",
    "tracked_mtp_losses",
]

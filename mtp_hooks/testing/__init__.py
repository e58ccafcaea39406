"""Tiny real Megatron-Core models on CPU, for tests, examples and benchmarks (like ``torch.testing``).

Stock mcore assumes CUDA in a few places a tiny run reaches. This package answers them on CPU and
builds small real models (mcore's own ``GPTModel``, ``MultiTokenPredictionBlock``, MoE and MLA
layers; no fake classes) next to which a hooked twin can be checked:

* ``devices``: ``cuda_current_device_is_cpu()``, ``cuda_calls_on_cpu()`` (context managers);
* ``attention``: ``SDPAttention``, a CPU core attention with GQA, MLA head dims, packed sequences
  and context parallelism; ``specs``: ``local_layer_spec()``, ``replace_module_class``;
* ``parallel``: ``init_parallel()`` (gloo, one process or spawned ranks), ``runtime()`` (one
  process on the GPU if visible, else the CPU), ``free_port()``;
* ``config``: ``cpu_safe_config()``, the ``TransformerConfig`` settings with every fused kernel off;
* ``gpt`` / ``deepseek`` / ``hybrid``: ``TinyGPT``, ``TinyQwen`` (GQA), ``TinyDeepSeek`` (MLA + MoE,
  inside ``moe_mla_on_cpu()``), ``TinyHybrid`` / ``TinyHybridMoE`` (megatron-core 0.18+);
* ``kernels``: ``fused_wgrad_kernel_on_cpu()``, a CPU stand-in for Apex's fused wgrad kernel;
* ``environ``: ``environ_kept()``, which gives ``os.environ`` back; every builder here runs in it, so the
  ``NVTE_*`` attention variables mcore sets while building a model do not outlive the build;
* ``twins``: the side-by-side harness: ``build_twins`` (-> ``Twins``, whose ``assert_step_matches``
  checks logits, MTP losses and every gradient in one call), batches (``make_batch``), the stock
  and hooked training steps (``stock_train_step``, ``hooked_train_step``) and the comparisons
  (``assert_same_grads``, ``assert_same_mtp_losses``).
* ``speculative``: one speculative-sampling loop (``speculative_sampling``, ``Proposal``), shared by the
  acceptance benchmark and the tests' engines;
* ``engine_models`` (import it by name): DeepSeek-V3, GLM-4.5 and MiMo models with a counting target
  and drafts whose acceptance the weights predict, written as HF folders vLLM loads (``docs/engine.md``).

Importing this package changes nothing in torch, megatron-core or the process environment: every change
is made by a context manager and undone on its exit. ``mtp_hooks`` itself needs none of it.

Example::

    from mtp_hooks import testing

    testing.init_parallel()
    with testing.cuda_current_device_is_cpu():
        twins = testing.build_twins(testing.TinyQwen(), seed=0)   # stock + hooked, same weights
        twins.assert_step_matches(testing.make_batch(vocab_size=64, seq=16))
"""

import warnings as _warnings

with _warnings.catch_warnings():
    # megatron-core's notices, at import, that it falls back from optional fused kernels (as mtp_hooks does).
    _warnings.filterwarnings(
        "ignore",
        message=r"(Transformer Engine and Apex are|Apex is|absl\.logging is) not installed",
        category=UserWarning,
        module=r"megatron\.",
    )
    from mtp_hooks.testing.attention import SDPAttention, context_parallel_positions
    from mtp_hooks.testing.config import cpu_safe_config
    from mtp_hooks.testing.deepseek import TinyDeepSeek, deepseek_missing, moe_mla_on_cpu
    from mtp_hooks.testing.devices import CudaToCpu, cuda_calls_on_cpu, cuda_current_device_is_cpu
    from mtp_hooks.testing.environ import environ_kept
    from mtp_hooks.testing.gpt import TinyGPT, TinyQwen
    from mtp_hooks.testing.hybrid import TinyHybrid, TinyHybridMoE, hybrid_moe_missing, hybrid_mtp_missing
    from mtp_hooks.testing.kernels import fused_wgrad_kernel_on_cpu
    from mtp_hooks.testing.parallel import free_port, init_parallel, runtime
    from mtp_hooks.testing.specs import SequenceParallelLayerNorm, local_layer_spec, replace_module_class
    from mtp_hooks.testing.twins import PATHS, Batch, ModelShape, StockRun, Twins, TwinStep, build_twins, make_batch
    from mtp_hooks.testing.twins import assert_same_grads, assert_same_mtp_losses, grads_of, hooked_mtp_losses
    from mtp_hooks.testing.twins import hooked_forward, hooked_train_step, main_ce_from_logits, masked_mean
    from mtp_hooks.testing.twins import output_layer_calls
    from mtp_hooks.testing.twins import stock_main_only_step, stock_mtp_losses, stock_train_step, tracked_mtp_losses

__all__ = [
    "Batch",
    "CudaToCpu",
    "ModelShape",
    "PATHS",
    "SDPAttention",
    "SequenceParallelLayerNorm",
    "StockRun",
    "TinyDeepSeek",
    "TinyGPT",
    "TinyHybrid",
    "TinyHybridMoE",
    "TinyQwen",
    "TwinStep",
    "Twins",
    "assert_same_grads",
    "assert_same_mtp_losses",
    "build_twins",
    "context_parallel_positions",
    "cpu_safe_config",
    "cuda_calls_on_cpu",
    "cuda_current_device_is_cpu",
    "deepseek_missing",
    "environ_kept",
    "free_port",
    "fused_wgrad_kernel_on_cpu",
    "grads_of",
    "hooked_forward",
    "hooked_mtp_losses",
    "hooked_train_step",
    "hybrid_moe_missing",
    "hybrid_mtp_missing",
    "init_parallel",
    "local_layer_spec",
    "main_ce_from_logits",
    "make_batch",
    "masked_mean",
    "moe_mla_on_cpu",
    "output_layer_calls",
    "replace_module_class",
    "runtime",
    "stock_main_only_step",
    "stock_mtp_losses",
    "stock_train_step",
    "tracked_mtp_losses",
]

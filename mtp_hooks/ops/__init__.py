"""The kernels: tensors in, tensors out, nothing about hooks or models.

Hidden states, the head weight, labels, token weights and the tensor-parallel group go in; losses,
log-probabilities and per-token statistics come out (``lean_loss``, ``logprobs``, with what each
objective, temperature and acceptance rule means in ``draft_rule``, the per-chunk math of
``objectives``, the vocabulary-parallel reductions of ``vocab_parallel``, the chunk buffer of
``workspace`` and mcore's ``main_grad`` weight-gradient protocol of ``main_grad``). A module here
imports torch, megatron-core, other modules of ``ops`` and ``mtp_hooks.errors`` (the exception types,
which import nothing of the package), never the hook runtime: ``tests/unit/test_layout.py`` holds it.
"""

"""Draft acceptance through an RL run: a frozen MTP draft against drafts trained inside RL.

``python -m benchmarks.acceptance [--task code|words] [--quick]`` (``make acceptance``). A real mcore
GPTModel with N = 2 MTP layers is first trained jointly (main + MTP losses, gradients into the
trunk, as stock mcore trains) on the task's text until it stops improving. Then one GRPO run is
replayed in variants that differ only in the draft:

* ``frozen``: the RL forward runs without labels (MTP block off); MTP parameters never change;
* ``ce`` / ``distill`` / ``tv`` / ``accept``: ``mtp_hooks.attach(objective=..., draft_temperature=T)``
  with ``detach_encoder=True, detach_head=True``, so MTP trains on the rollouts while the policy's
  gradients stay its own.

Tasks (``task.Task``): ``code`` (the default; ``code_task.py``):
the interpreter's own standard library, a byte-level BPE, function-definition prompts and a reward
verified on the generated code (it must parse, and double quotes score), run at rollout temperatures
T = 1.0 and 0.7 with the drafts trained at the same T; ``words``: the synthetic 12-word language
(``task.py``, V = 32, T = 1.0, the four original variants).
``--task code --config chain``: an N = 1 model, variants that also train a chain of k = 3 draft
steps (``ce+tf`` teacher-forced, ``ce+chain`` / ``accept+chain`` on their own sampled drafts), and
every variant evaluated drafting k = 3 steps as an engine does (``chain.py``).

Main and MTP parameters have separate Adam optimizers, rollouts come from one seeded generator,
and after every step the main parameters of all variants are checked to be bit-identical: the
policy trajectory is the same, only the draft differs. Every few steps, on fresh rollouts of the
current policy from held-out prompts (their own generator, never trained on), each variant reports
per depth the expected acceptance ``sum_v min(p, q)`` and top-1 agreement of a training-style
forward that is never backpropagated, the hooks' expected accepted length ``mtp/accept_len``, and
runs a real speculative sampling loop (``evaluate.py``). The policy's reward and its KL to the
pretrained policy are recorded per step.

The experiment is repeated for each of ``--seeds`` (default 0, 1, 2); tables give the mean and
min–max over seeds (``report.py``). Pretrained models of the code task are
cached per seed under ``bench-out/acceptance-cache/`` (with the tokenizer and token streams), so
reruns skip pretraining. ``--seeds 0 --out A``, ``--seeds 1 --out B``, ... run as separate processes
(side by side on separate cores), then ``--merge A B ... --out C`` joins them into one record.
Output: ``bench-out/acceptance/`` (``acceptance.json``, ``acceptance.md``, plots).

Modules, from the command down: ``run`` (the command line and outputs), ``experiment`` (one run per
seed and temperature), ``arms`` (a variant's model, hooks and optimizers; one GRPO step), ``evaluate``
(a variant's held-out draft quality), ``pretrain``, ``drafts`` (the N depths as the draft), ``chain``
(the k-step chain as the draft), ``task`` / ``code_task`` (the texts), ``settings``; ``report``,
``chain_report``, ``plots`` and ``figures`` write the record. ``--engine vllm`` (``make acceptance-engine``):
``engine_run`` (the RL run on a MiMo-shaped model, variants trained for a greedy vLLM 0.32 engine, snapshots),
``engine_measure`` (every snapshot's variants pushed into vLLM for k = 1..3 and measured, next to the trainer's
prediction on the engine's tokens), ``engine_report`` (table, verdict, plot). The speculative sampling loop is
``mtp_hooks.testing.speculative``'s, the model builder the cost benchmark's (``benchmarks.models``).
"""

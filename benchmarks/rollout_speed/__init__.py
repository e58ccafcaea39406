"""What a trained draft saves in rollout time, measured by vLLM (``make rollout-speed``).

The word task (``benchmarks.acceptance``) on a target where speculation can pay on this CPU: MiMo-shaped, 512 x 8
(31.5 M main parameters) with one MTP layer, pretrained jointly and cached as the acceptance benchmark caches its
own. A short GRPO run keeps the draft frozen in one variant and trains it with ``mtp_hooks`` in the other (vLLM 0.32's
profile, ``accept+profile``); both replay one run, so the policy is the same. Then vLLM generates the same sampled
rollouts (T = 1, the same seeds and number of tokens) without speculation, with the frozen draft and with the trained
one, in interleaved rounds, and says where a step's time goes (``timing``). ``report`` writes the record and the
verdict: in every seed no speculation takes >= 1.3x as long as the trained draft (wall medians), and the trained draft
is not slower than the frozen one: it needs no more engine steps (exact counts; both drafts are one MTP layer of the
same target, so a step costs the same), with the wall times beside.
"""

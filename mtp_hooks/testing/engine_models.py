"""mcore models whose draft acceptance is known from their weights, written as HF folders vLLM loads.

For the engine tests (``tests/engine``), benchmarks (``make engine-sync-bench``) and ``examples/engine_loop.py``.
Three families, each as vLLM's ``method="mtp"`` resolves it, at the sizes vLLM's CPU kernels take
(attention head sizes 32, 64, ...; MLA only with ``kv_lora_rank`` 512 and a RoPE head of 64):

* ``"deepseek_v3"``: ``TinyDeepSeek`` (MLA, a dense then a MoE layer, a MoE MTP layer) -> ``deepseek_mtp``;
* ``"glm4_moe"``: the same with grouped-query attention (qk norms, QKV bias) -> ``glm4_moe_mtp``;
* ``"mimo"``: ``TinyQwen`` (dense GQA, QKV bias) -> ``mimo_mtp``.

The weights (``set_count_weights``) make a "counting" target: every residual branch (attention
output, dense and expert ``linear_fc2``) is zero, so the hidden state is the token's embedding
``E[x]``, and ``output_layer[y] = E[y - 1] / sqrt(H)``: the target's greedy next token after ``x`` is
``x + 1``. The MTP layer's ``eh_proj`` is ``[A, 0]`` in mcore's order ``cat(enorm(embedding),
hnorm(hidden))``: ``A = I`` applies the target's rule one token ahead ("copy", a perfect draft),
``I + sigma R`` drafts worse as sigma grows ("noisy"), a random ``eh_proj`` almost never right
("random"). What the draft proposes after ``x`` is then ``argmax W rms(A rms(E[x]))``, computed
from the weights by ``draft_rule`` and ``predicted_acceptance`` (T = 0); at T > 0 the engine keeps it
with probability ``p_T(draft | x)`` (``target_probabilities``, ``sampled_draft_probabilities``). The full
tensors come from seeded generators and each rank keeps its TP shard, so TP / PP / EP builds hold the same model.

The folders are written by the library's own export (``mtp_hooks.export.save_hf_folder`` /
``write_hf_folder``, ``hf_config``) with a few fixed values (``_fixed``) and a word-level tokenizer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from mtp_hooks.export import FAMILIES as EXPORT_FAMILIES
from mtp_hooks.export import hf_config as derived_hf_config
from mtp_hooks.export import hf_weights, save_hf_folder, write_hf_folder
from mtp_hooks.testing.engine_shapes import (  # noqa: F401 (the shapes, where the engine tests read them)
    EPS, FAMILIES, HIDDEN, LAYERS, VOCAB, TinyGlm, family_missing, shape
)

LAYOUTS = {family: EXPORT_FAMILIES[family] for family in FAMILIES}


# What the folders fix beyond what the export derives from the model: the tokenizer's ids, a longer
# position range, and GLM-4.5's shipped partial rotary share (the counting target's attention output
# is zero, so its RoPE does not matter).
def _fixed(family: str) -> dict[str, Any]:
    fixed: dict[str, Any] = dict(max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)
    if family == "glm4_moe":
        fixed["partial_rotary_factor"] = 0.5
    return fixed


def hf_config(family: str, config: Any, vocab_size: int = VOCAB, dtype: str = "bfloat16") -> dict[str, Any]:
    """``config.json`` of ``family`` for an mcore ``config`` (vLLM picks the model class by ``architectures``):
    ``mtp_hooks.export.hf_config`` with this module's fixed values."""
    model_values = dict(vocab_size=vocab_size, tie_word_embeddings=False, rope_theta=10000.0)
    return derived_hf_config(config, family, dtype=dtype, **model_values, **_fixed(family))


def _local(full: Tensor, param: Tensor) -> Tensor:
    """This rank's TP shard of ``full`` for ``param`` (its ``partition_dim``), or ``full``."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return full
    size, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    return full.chunk(size, dim=param.partition_dim)[rank]


def embedding(seed: int = 0) -> Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def draft_matrix(draft: str, sigma: float = 0.0, seed: int = 0) -> Tensor:
    """``eh_proj`` ``[H, 2H]`` of a ``draft`` ("copy", "noisy", "random") in mcore's column order."""
    generator = torch.Generator().manual_seed(seed + 1)
    if draft == "random":
        return torch.randn(HIDDEN, 2 * HIDDEN, generator=generator) * 0.02
    noise = sigma * torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5 if draft == "noisy" else 0.0
    left = torch.eye(HIDDEN) + noise
    return torch.cat([left, torch.zeros(HIDDEN, HIDDEN)], dim=1)


@torch.no_grad()
def set_count_weights(model: torch.nn.Module, draft: str = "copy", sigma: float = 0.0, seed: int = 0) -> None:
    """Give ``model`` (any TP / PP / EP rank of it) the counting target and a ``draft`` MTP layer."""
    head = torch.roll(embedding(seed), 1, 0) / HIDDEN**0.5
    full = {"embedding.word_embeddings.weight": embedding(seed), "output_layer.weight": head}
    for name, param in model.named_parameters():
        if name in full:
            param.copy_(_local(full[name], param))
        elif re.search(r"(linear_proj|linear_fc2)\.(weight\d*|bias)$", name):
            param.zero_()  # every residual branch: attention output, dense, shared and routed experts
        elif re.search(r"(layernorm|norm)\.weight$|^mtp\.layers\.\d+\.(enorm|hnorm)\.weight$|layer_norm_weight$", name):
            param.fill_(1.0)
        elif re.match(r"^mtp\.layers\.\d+\.eh_proj\.weight$", name):
            param.copy_(_local(draft_matrix(draft, sigma, seed), param))


def main_hf_pairs(model: torch.nn.Module, family: str) -> Iterator[tuple[str, Tensor]]:
    """The main model's tensors of an unsharded ``model`` under the family's HF names
    (``mtp_hooks.export.hf_weights(..., mtp=False)``: embedding, decoder layers, final norm, head)."""
    return hf_weights(model, LAYOUTS[family], mtp=False)


def tokenizer(vocab_size: int = VOCAB) -> Any:
    """A word-level tokenizer over ``<s>``, ``</s>``, ``t2`` .. ``t{V-1}`` (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>", unk_token="t2")


def write_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """``tokenizer(vocab_size)`` saved into ``folder``."""
    tokenizer(vocab_size).save_pretrained(str(folder))


def write_folder(
    folder: Path,
    family: str,
    config: Any,
    pairs: Sequence[tuple[str, Tensor]] | Iterator[tuple[str, Tensor]],
    vocab_size: int = VOCAB,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """An HF folder vLLM loads: ``config.json``, the tokenizer and ``pairs`` as ``model.safetensors`` in ``dtype``
    (the dtype ``config.json`` names: bf16, or fp32 for exact T = 0 comparisons with an fp32 trainer)."""
    config_json = hf_config(family, config, vocab_size, str(dtype).removeprefix("torch."))
    return write_hf_folder(folder, pairs, config_json, tokenizer=tokenizer(vocab_size), dtype=dtype)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def target_rule(seed: int = 0) -> Tensor:
    """The target's greedy next token after each token ``x`` (``x + 1`` but for rounding)."""
    E = embedding(seed)
    return (_rms(E) @ (torch.roll(E, 1, 0) / HIDDEN**0.5).T).argmax(-1)


def draft_rule(eh_proj: Tensor, seed: int = 0) -> Tensor:
    """What an MTP layer with ``eh_proj`` (mcore order, full) drafts after each token ``x``."""
    E = embedding(seed)
    A = eh_proj.detach().float()[:, :HIDDEN]
    return (_rms(_rms(E) @ A.T) @ (torch.roll(E, 1, 0) / HIDDEN**0.5).T).argmax(-1)


def predicted_acceptance(eh_proj: Tensor, prompts: Sequence[Sequence[int]], max_tokens: int, seed: int = 0) -> float:
    """The acceptance a k = 1 engine measures at T = 0, from the weights: the engine's own steps
    replayed with the target's and the draft's rules (the prefill gives the first token; each
    step then drafts after the last token and, if the draft is the target's, ends with the bonus
    token one further)."""
    target, drafted = target_rule(seed).tolist(), draft_rule(eh_proj, seed).tolist()
    drafts = accepted = 0
    for prompt in prompts:
        last, produced = target[prompt[-1]], 1
        while produced < max_tokens:
            drafts += 1
            if drafted[last] == target[last]:
                accepted += 1
                last, produced = target[target[last]], produced + 2
            else:
                last, produced = target[last], produced + 1
    return accepted / drafts


def target_probabilities(temperature: float, seed: int = 0) -> Tensor:
    """``p_T(y | x)`` of the counting target, ``[V, V]``, from its weights as the engine holds them
    (bf16): the hidden state after ``x`` is ``E[x]``, every residual branch being zero."""
    E = embedding(seed)
    head = (torch.roll(E, 1, 0) / HIDDEN**0.5).to(torch.bfloat16).float()
    return torch.softmax(_rms(E.to(torch.bfloat16).float()) @ head.T / temperature, -1)


def sampled_draft_probabilities(
    eh_proj: Tensor, token_ids: Sequence[Sequence[int]], temperature: float, seed: int = 0
) -> Tensor:
    """``p_T(d | x)`` at each draft position of a k = 1 engine's run at ``temperature``, replayed
    from the tokens it generated: after the last token ``x`` the draft is ``d = draft_rule[x]`` (the
    argmax), which vLLM keeps with probability ``p_T(d | x)``; kept, the next two tokens are ``d``
    and the bonus token, rejected, the next one is resampled without ``d``. Their mean is the
    acceptance the weights predict, ``sqrt(sum p (1 - p))`` over their count its standard error."""
    drafted = draft_rule(eh_proj, seed).tolist()
    positions: list[tuple[int, int]] = []
    for tokens in token_ids:
        i = 0
        while i < len(tokens) - 1:
            positions.append((tokens[i], drafted[tokens[i]]))
            i += 2 if tokens[i + 1] == drafted[tokens[i]] else 1
    x, d = torch.tensor(positions, dtype=torch.int64).reshape(-1, 2).unbind(1)
    return target_probabilities(temperature, seed)[x, d]


def counting_steps(
    prompts: Sequence[Sequence[int]], token_ids: Sequence[Sequence[int]], seed: int = 0
) -> tuple[int, int]:
    """(steps that follow the target's greedy rule, steps) over the generated tokens, each prompt's
    last token first: the rate is ``p_T(x + 1 | x)`` averaged, whether or not the engine speculates."""
    rule = target_rule(seed).tolist()
    steps = [(a, b) for prompt, tokens in zip(prompts, token_ids) for a, b in zip([prompt[-1], *tokens], tokens)]
    return sum(b == rule[a] for a, b in steps), len(steps)


def counting_prompts(count: int = 16, length: int = 8) -> list[list[int]]:
    """``count`` prompts ``s, s+1, ...`` spread over the vocabulary (tokens 2 .. V-1)."""
    starts = [2 + (i * (VOCAB - 2)) // count for i in range(count)]
    return [[2 + (s + j - 2) % (VOCAB - 2) for j in range(length)] for s in starts]


def trainer(
    family: str, draft: str = "copy", sigma: float = 0.0, mtp_num_layers: int = 1, seed: int = 0, **model_kwargs: Any
) -> torch.nn.Module:
    """The family's mcore model (this process's parallel layout; ``model_kwargs`` to ``GPTModel``,
    e.g. a pipeline stage's ``pre_process``) with the counting target and ``draft``."""
    from mtp_hooks.testing import moe_mla_on_cpu

    with moe_mla_on_cpu():
        model = shape(family, mtp_num_layers).build(**model_kwargs)
    set_count_weights(model, draft, sigma, seed)
    return model


def engine_folder(folder: Path, family: str, model: torch.nn.Module) -> Path:
    """``model`` (unsharded) as an HF folder: ``mtp_hooks.export.save_hf_folder`` with this module's
    fixed config values and tokenizer."""
    return save_hf_folder(folder, model, family, config=_fixed(family), tokenizer=tokenizer(model.vocab_size))

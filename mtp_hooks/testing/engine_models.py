"""mcore models whose draft acceptance is known from their weights, written as HF folders vLLM loads.

For the engine tests (``tests/engine``) and benchmarks (``make engine-sync-bench``). Three families, each as vLLM's ``method="mtp"`` resolves it,
at the sizes vLLM's CPU kernels take (attention head sizes 32, 64, ...; MLA only with
``kv_lora_rank`` 512 and a RoPE head of 64):

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
with probability ``p_T(draft | x)`` (``target_probabilities``, ``sampled_draft_probabilities``). The full tensors come from seeded
generators and each rank keeps its TP shard, so TP / PP / EP builds hold the same model.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

import torch.nn.functional as F

from mtp_hooks.export.convert import hf_pairs
from mtp_hooks.export.layouts import layout_named
from mtp_hooks.testing.deepseek import TinyDeepSeek
from mtp_hooks.testing.gpt import TinyQwen

FAMILIES = ("deepseek_v3", "glm4_moe", "mimo")
LAYOUTS = {"deepseek_v3": "deepseek_v3", "glm4_moe": "deepseek_v3", "mimo": "mimo"}
VOCAB, HIDDEN, LAYERS = 1024, 128, 2
EPS = 1e-6  # RMSNorm epsilon on both sides

# What DeepSeek-V3's (and GLM-4.5's) HF layer computes and TinyDeepSeek's defaults leave out.
_DEEPSEEK_V3_STYLE: dict[str, Any] = dict(
    gated_linear_unit=True, activation_func=F.silu, qk_layernorm=True, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
)
_MLA = dict(q_lora_rank=None, kv_lora_rank=512, qk_head_dim=32, qk_pos_emb_head_dim=64, v_head_dim=32, layernorm_epsilon=EPS)


@dataclasses.dataclass
class TinyGlm(TinyDeepSeek):
    """``TinyDeepSeek``'s layers (dense then MoE, MoE MTP layers) with grouped-query attention, as
    GLM-4.5: qk norms, a bias on the QKV projection only."""

    num_query_groups: int = 2

    def config(self) -> Any:
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        mla = TinyDeepSeek.config(self)
        mla_only = {f.name for f in dataclasses.fields(MLATransformerConfig)} - {f.name for f in dataclasses.fields(TransformerConfig)}
        kwargs = {f.name: getattr(mla, f.name) for f in dataclasses.fields(TransformerConfig) if f.init and f.name not in mla_only}
        kwargs.update(multi_latent_attention=False, num_query_groups=self.num_query_groups, kv_channels=self.hidden_size // self.num_attention_heads)
        kwargs.update(qk_layernorm=True, add_qkv_bias=True)
        return TransformerConfig(**kwargs)


def shape(family: str, mtp_num_layers: int = 1, *, hidden_size: int = HIDDEN, num_layers: int = LAYERS, vocab_size: int = VOCAB) -> Any:
    """The mcore shape of ``family`` (build inside ``moe_mla_on_cpu()`` for the MoE families).
    The counting weights need the default sizes; other sizes serve benchmarks with random weights."""
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, mtp_num_layers=mtp_num_layers, max_sequence_length=512)
    if family == "deepseek_v3":
        return TinyDeepSeek(num_attention_heads=2, config_overrides={**_DEEPSEEK_V3_STYLE, **_MLA}, **sizes)
    if family == "glm4_moe":
        return TinyGlm(num_attention_heads=hidden_size // 32, config_overrides={**_DEEPSEEK_V3_STYLE, "layernorm_epsilon": EPS}, **sizes)
    if family == "mimo":
        return TinyQwen(num_attention_heads=hidden_size // 32, num_query_groups=hidden_size // 64, config_overrides={"layernorm_epsilon": EPS}, **sizes)
    raise ValueError(f"family: expected one of {FAMILIES}, received {family!r}")


def hf_config(family: str, config: Any, vocab_size: int = VOCAB, dtype: str = "bfloat16") -> dict[str, Any]:
    """``config.json`` of ``family`` for an mcore ``config`` (vLLM picks the model class by ``architectures``)."""
    common = dict(
        vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_nextn_predict_layers=config.mtp_num_layers, rms_norm_eps=EPS, tie_word_embeddings=False, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1, dtype=dtype, hidden_act="silu",
    )
    if family == "mimo":
        return dict(common, architectures=["MiMoForCausalLM"], model_type="qwen2", intermediate_size=config.ffn_hidden_size,
                    num_key_value_heads=config.num_query_groups, rope_theta=10000.0, use_sliding_window=False)
    moe = dict(
        intermediate_size=config.ffn_hidden_size, moe_intermediate_size=config.moe_ffn_hidden_size, n_shared_experts=1,
        n_routed_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
    )
    if family == "glm4_moe":
        return dict(common, **moe, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_key_value_heads=config.num_query_groups,
                    head_dim=config.kv_channels, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, rope_theta=10000.0)
    # the real DeepSeek-V3 config.json's topk_method / scoring_func: without "noaux_tc" vLLM's gate has
    # no e_score_correction_bias to load into
    return dict(common, **moe, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=config.num_attention_heads,
                kv_lora_rank=config.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=config.qk_pos_emb_head_dim,
                qk_nope_head_dim=config.qk_head_dim, v_head_dim=config.v_head_dim, rope_theta=10000.0)


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
    left = torch.eye(HIDDEN) + (sigma * torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5 if draft == "noisy" else 0.0)
    return torch.cat([left, torch.zeros(HIDDEN, HIDDEN)], dim=1)


@torch.no_grad()
def set_count_weights(model: torch.nn.Module, draft: str = "copy", sigma: float = 0.0, seed: int = 0) -> None:
    """Give ``model`` (any TP / PP / EP rank of it) the counting target and a ``draft`` MTP layer."""
    full = {"embedding.word_embeddings.weight": embedding(seed), "output_layer.weight": torch.roll(embedding(seed), 1, 0) / HIDDEN**0.5}
    for name, param in model.named_parameters():
        if name in full:
            param.copy_(_local(full[name], param))
        elif re.search(r"(linear_proj|linear_fc2)\.(weight\d*|bias)$", name):
            param.zero_()  # every residual branch: attention output, dense, shared and routed experts
        elif re.search(r"(layernorm|norm)\.weight$|^mtp\.layers\.\d+\.(enorm|hnorm)\.weight$", name) or name.endswith("layer_norm_weight"):
            param.fill_(1.0)
        elif re.match(r"^mtp\.layers\.\d+\.eh_proj\.weight$", name):
            param.copy_(_local(draft_matrix(draft, sigma, seed), param))


def main_hf_pairs(model: torch.nn.Module, family: str) -> Iterator[tuple[str, Tensor]]:
    """The main model's tensors of an unsharded ``model`` under the family's HF names (decoder layers
    by the export's own decoder-layer table; embedding, final norm and head)."""
    layout = layout_named(LAYOUTS[family])
    config = model.config
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
    mtp_prefix = layout.layer_prefix(config.num_layers, 0)
    for name, tensor in model.state_dict().items():
        if name in top:
            yield top[name], tensor
        found = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
        if found and not name.endswith("_extra_state"):
            for hf_name, part in hf_pairs(f"mtp.layers.0.transformer_layer.{found.group(2)}", tensor, config, layout):
                yield f"model.layers.{found.group(1)}." + hf_name.removeprefix(mtp_prefix), part


def write_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer over ``<s>``, ``</s>``, ``t2`` .. ``t{V-1}`` (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="t2").save_pretrained(str(folder))


def write_folder(
    folder: Path, family: str, config: Any, pairs: Sequence[tuple[str, Tensor]] | Iterator[tuple[str, Tensor]], vocab_size: int = VOCAB,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """An HF folder vLLM loads: ``config.json``, the tokenizer and ``pairs`` as ``model.safetensors`` in ``dtype``
    (the dtype ``config.json`` names: bf16, or fp32 for exact T = 0 comparisons with an fp32 trainer)."""
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    for name, tensor in pairs:
        if name in tensors:
            raise AssertionError(f"two tensors under {name}")
        tensors[name] = tensor.detach().to(dtype).contiguous().clone()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(family, config, vocab_size, str(dtype).removeprefix("torch.")), indent=2))
    write_tokenizer(folder, vocab_size)
    return folder


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


def sampled_draft_probabilities(eh_proj: Tensor, token_ids: Sequence[Sequence[int]], temperature: float, seed: int = 0) -> Tensor:
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


def counting_steps(prompts: Sequence[Sequence[int]], token_ids: Sequence[Sequence[int]], seed: int = 0) -> tuple[int, int]:
    """(steps that follow the target's greedy rule, steps) over the generated tokens, each prompt's
    last token first: the rate is ``p_T(x + 1 | x)`` averaged, whether or not the engine speculates."""
    rule = target_rule(seed).tolist()
    steps = [(a, b) for prompt, tokens in zip(prompts, token_ids) for a, b in zip([prompt[-1], *tokens], tokens)]
    return sum(b == rule[a] for a, b in steps), len(steps)


def counting_prompts(count: int = 16, length: int = 8) -> list[list[int]]:
    """``count`` prompts ``s, s+1, ...`` spread over the vocabulary (tokens 2 .. V-1)."""
    starts = [2 + (i * (VOCAB - 2)) // count for i in range(count)]
    return [[2 + (s + j - 2) % (VOCAB - 2) for j in range(length)] for s in starts]


def trainer(family: str, draft: str = "copy", sigma: float = 0.0, mtp_num_layers: int = 1, seed: int = 0, **model_kwargs: Any) -> torch.nn.Module:
    """The family's mcore model (this process's parallel layout; ``model_kwargs`` to ``GPTModel``,
    e.g. a pipeline stage's ``pre_process``) with the counting target and ``draft``."""
    from mtp_hooks.testing import moe_mla_on_cpu

    with moe_mla_on_cpu():
        model = shape(family, mtp_num_layers).build(**model_kwargs)
    set_count_weights(model, draft, sigma, seed)
    return model


def engine_folder(folder: Path, family: str, model: torch.nn.Module) -> Path:
    """``model`` (unsharded) as an HF folder: the main model here, the MTP layers by ``mtp_hf_weights``."""
    from mtp_hooks.export import mtp_hf_weights

    pairs = [*main_hf_pairs(model, family), *mtp_hf_weights(model, LAYOUTS[family])]
    return write_folder(folder, family, model.config, pairs, model.vocab_size)

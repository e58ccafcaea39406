"""The real-text task of the acceptance benchmark: Python code from the interpreter's own standard library.

Corpus: the ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), minus tests, ``site-packages``, IDLE, demos and other
non-library folders. It is real code that no one in this project wrote, and it ships on every
machine that runs the benchmark, so the task needs no download. The file list is sorted; a file is
held out when a hash of its relative path says so (about 1 in 5), and the held-out files are split
again, by the same hash, into RL prompts and evaluation prompts. Nothing is trained on them.

Tokenizer: a byte-level BPE trained here with the ``tokenizers`` library on the training files,
cached under ``bench-out/`` by corpus and vocabulary size.

Prompts are the first tokens of held-out function definitions (from the line's indentation on).
Reward, verifiable on the generated code, from the function's complete lines (prompt + completion,
up to the first line that leaves the function's body): ``0.5`` if they parse with ``ast``, plus
``0.5 * the share of their string literals written with double quotes`` (none: 0; code that does
not tokenize to its end counts the literals before the error). The standard
library writes about three quarters of its one-line string literals with single quotes, so the
pretrained model rarely follows the rule: RL has to move it.
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import sysconfig
import tokenize as pytokenize
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

EOT = "<|endoftext|>"
SKIP = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib", "lib2to3", "turtledemo",
                  "tkinter", "ensurepip", "pydoc_data", "__pycache__", "__phello__", "config-3.11-x86_64-linux-gnu"})
_DEF = re.compile(r"^[ \t]*(async[ \t]+)?def[ \t]", re.MULTILINE)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def stdlib_files(limit: Optional[int] = None) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the standard library's ``*.py`` files, sorted by path; with
    ``limit``, the ``limit`` files that a hash of the path ranks first (a deterministic sample
    spread over the whole library), still returned in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & SKIP))
    if limit is not None:
        keep = set(sorted(paths, key=lambda p: _hash(p.relative_to(root).as_posix()))[:limit])
        paths = [p for p in paths if p in keep]
    out = []
    for path in paths:
        try:
            out.append((path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def split(files: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """``train`` (hash % 5 != 0), and the held-out files as ``rl`` and ``eval`` prompts' sources."""
    parts: dict[str, list[tuple[str, str]]] = {"train": [], "rl": [], "eval": []}
    for rel, text in files:
        h = _hash(rel)
        parts["train" if h % 5 else ("rl" if (h // 10) % 2 == 0 else "eval")].append((rel, text))
    return parts


def corpus_key(files: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for rel, text in files:
        digest.update(rel.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab: int, cache: Path, key: str) -> Any:
    """A byte-level BPE of at most ``vocab`` tokens trained on ``texts``; loaded from ``cache`` when
    a tokenizer for the same corpus key and vocabulary size is there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache / f"bpe-{key}-V{vocab}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def function_prompts(tokenizer: Any, files: list[tuple[str, str]], length: int) -> Tensor:
    """``[n, length]``: the first ``length`` tokens of every function definition (from the start of
    its ``def`` line) whose text has at least that many tokens."""
    rows = []
    for _, text in files:
        for match in _DEF.finditer(text):
            ids = tokenizer.encode(text[match.start() : match.start() + 40 * length]).ids
            if len(ids) >= length:
                rows.append(ids[:length])
    return torch.tensor(rows, dtype=torch.long)


def function_lines(text: str) -> Optional[str]:
    """The function's complete lines, dedented, with a ``pass`` body where the last one opens a block:
    lines up to the last newline, stopping at the first non-blank line not indented past the
    ``def`` line. ``None`` when not even the ``def`` line is complete."""
    lines = text.split("\n")[:-1]  # the last piece has no newline: incomplete
    if not lines:
        return None
    indent = len(lines[0]) - len(lines[0].lstrip())
    kept = [lines[0][indent:]]
    for line in lines[1:]:
        stripped = line.lstrip()
        if stripped and len(line) - len(stripped) <= indent:
            break
        kept.append(line[indent:] if stripped else "")
    last = next(line for line in reversed(kept) if line.strip())
    if last.rstrip().endswith(":"):
        kept.append(" " * (len(last) - len(last.lstrip()) + 4) + "pass")
    return "\n".join(kept) + "\n"


def quote_share(code: str) -> float:
    """Share of the string literals (not triple-quoted) written with double quotes; 0 if none."""
    double = total = 0
    try:
        for token in pytokenize.generate_tokens(io.StringIO(code).readline):
            if token.type == pytokenize.STRING:
                body = token.string.lstrip("rbuRBUfF")
                if body[:3] in ('"""', "'''"):
                    continue
                total += 1
                double += body.startswith('"')
    except (pytokenize.TokenError, SyntaxError):
        pass  # count the literals before the error
    return double / total if total else 0.0


def score(text: str) -> tuple[bool, float]:
    """(the function's complete lines parse, their double-quote share)."""
    code = function_lines(text)
    if code is None:
        return False, 0.0
    try:
        with warnings.catch_warnings():  # generated code: invalid escapes and the like are not news
            warnings.simplefilter("ignore")
            ast.parse(code)
    except (SyntaxError, ValueError):
        return False, quote_share(code)
    return True, quote_share(code)


def encode_stream(tokenizer: Any, texts: list[str]) -> Tensor:
    """All texts' tokens in one 1-D stream, each file followed by the end-of-text token."""
    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def describe_corpus(parts: dict[str, list[tuple[str, str]]], tokenizer: Any) -> dict[str, Any]:
    return {
        "stdlib": sysconfig.get_paths()["stdlib"],
        "files": {k: len(v) for k, v in parts.items()},
        "characters": {k: sum(len(t) for _, t in v) for k, v in parts.items()},
        "vocab": tokenizer.get_vocab_size(),
        "eval_files": [rel for rel, _ in parts["eval"]][:20],
    }


_BUILT: dict[tuple[Optional[int], int, str], dict[str, Any]] = {}


def _corpus(files: Optional[int], vocab: int, cache: Path) -> dict[str, Any]:
    """Split, tokenizer and the token streams of one corpus (built once per process, streams cached)."""
    memo = (files, vocab, str(cache))
    if memo in _BUILT:
        return _BUILT[memo]
    parts = split(stdlib_files(files))
    if not parts["train"] or not parts["rl"] or not parts["eval"]:
        raise ValueError(f"files={files}: too few standard-library files for a train / rl / eval split ({ {k: len(v) for k, v in parts.items()} })")
    key = corpus_key(parts["train"] + parts["rl"] + parts["eval"])
    tokenizer = train_tokenizer([t for _, t in parts["train"]], vocab, cache, key)
    stream_path = cache / f"streams-{key}-V{vocab}.pt"
    if stream_path.exists():
        streams = torch.load(stream_path)
    else:
        streams = {name: encode_stream(tokenizer, [t for _, t in parts[name]]) for name in ("train", "rl", "eval")}
        torch.save(streams, stream_path)
    _BUILT[memo] = {"parts": parts, "key": key, "tokenizer": tokenizer, "streams": streams}
    return _BUILT[memo]


class CodeTask:
    """The standard library's code as a ``benchmarks.acceptance.task.Task`` (see the module docstring)."""

    name = "code"
    policy_metrics = ("parses", "double_quotes")

    def __init__(self, setting: Any, cache: Path) -> None:
        built = _corpus(setting.files, setting.vocab, Path(cache))
        self.tokenizer = built["tokenizer"]
        if self.tokenizer.get_vocab_size() > setting.vocab:
            raise ValueError(f"tokenizer has {self.tokenizer.get_vocab_size()} tokens, the model {setting.vocab}")
        self.key = built["key"]
        self.parts = built["parts"]
        self.train = built["streams"]["train"]
        held = torch.cat([built["streams"]["rl"], built["streams"]["eval"]])
        windows = max(1, min(setting.held_out_windows, (len(held) - 1) // setting.sft_seq))
        starts = torch.linspace(0, len(held) - setting.sft_seq - 1, windows).long()
        self._held_out = torch.stack([held[s : s + setting.sft_seq] for s in starts.tolist()])
        self.pools = {name: function_prompts(self.tokenizer, self.parts[name], setting.prompt) for name in ("rl", "eval")}
        for name, pool in self.pools.items():
            if len(pool) == 0:
                raise ValueError(f"no function of at least {setting.prompt} tokens in the {name!r} files")

    @classmethod
    def build(cls, setting: Any, seed: int, cache: Path) -> "CodeTask":
        return cls(setting, cache)  # the corpus is the same for every seed

    def pretrain_batch(self, count: int, length: int, gen: torch.Generator) -> Tensor:
        starts = torch.randint(0, len(self.train) - length, (count,), generator=gen)
        return torch.stack([self.train[s : s + length] for s in starts.tolist()])

    def held_out(self) -> Optional[Tensor]:
        return self._held_out

    def prompts(self, count: int, split: str, gen: torch.Generator) -> Tensor:
        pool = self.pools[split]
        return pool[torch.randint(0, len(pool), (count,), generator=gen)]

    def _scores(self, tokens: Tensor) -> list[tuple[bool, float]]:
        return [score(text) for text in self.tokenizer.decode_batch(tokens.tolist(), skip_special_tokens=False)]

    def reward(self, tokens: Tensor, prompt: int) -> Tensor:
        return torch.tensor([0.5 * ok + 0.5 * share for ok, share in self._scores(tokens)])

    def describe(self, tokens: Tensor, prompt: int) -> dict[str, float]:
        scores = self._scores(tokens)
        return {"parses": sum(ok for ok, _ in scores) / len(scores), "double_quotes": sum(share for _, share in scores) / len(scores)}

    def examples(self, tokens: Tensor) -> list[Any]:
        return self.tokenizer.decode_batch(tokens.tolist(), skip_special_tokens=False)

    def info(self) -> dict[str, Any]:
        return {**describe_corpus(self.parts, self.tokenizer), "corpus_key": self.key, "prompts": {k: len(v) for k, v in self.pools.items()},
                "train_tokens": len(self.train), "held_out_windows": list(self._held_out.shape)}

    def cache_key(self) -> Optional[str]:
        return f"code-{self.key}"

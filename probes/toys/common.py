"""What the toy models share: where a trained toy lives, training it once under a lock,
word-level tokenizers (numbers and words as single tokens, so traces are short and labels exact),
and the chained-arithmetic problem the reasoning and MoE toys are trained on.

Example:
    >>> tok = word_tokenizer(["Q", ":", "1", "+", "2", "=", "3"])
    >>> tok("Q : 1 + 2 = 3")["input_ids"][-3:] == tok.convert_tokens_to_ids(["2", "=", "3"])
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.paths import user_cache_dir
from probes.toys.verify import verified
from thoughtscope.errors import ModelLoadError

log = logging.getLogger(__name__)

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
DONE_MARKER = "trained.json"


def recipe_hash(recipe: dict[str, Any]) -> str:
    """A short hash of everything that decides a toy's weights (config, data, steps, seed)."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]


def toy_folder(name: str, size: str, recipe: dict[str, Any]) -> Path:
    return user_cache_dir() / "models" / f"{name}-{size}-{recipe_hash(recipe)}"


def is_trained(folder: Path) -> bool:
    """True if `folder` holds a finished run whose weights are whole (not cut short by a full disk)."""
    from probes.model_files import safetensors_problem

    return (folder / DONE_MARKER).is_file() and safetensors_problem(folder / "model.safetensors") is None


def train_once(folder: Path, train: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `train(tmp_folder) -> report` unless `folder` already holds a finished model.

    A file lock makes concurrent processes (test workers, app and server) train only once; the
    model is written to a temporary folder and renamed, so a killed run leaves no half model behind
    (its temporary folder is removed by the next run).
    """
    from filelock import FileLock

    from probes.model_files import remove_stale_temps, safetensors_problem

    if is_trained(folder):
        remove_stale_temps(folder)  # a killed run's folder, even when another run finished
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if is_trained(folder):
            return folder
        if folder.exists():
            log.warning("thoughtscope: %s is damaged (model.safetensors: %s); training it again", folder,
                        safetensors_problem(folder / "model.safetensors") or f"no {DONE_MARKER}")
        for stale in folder.parent.glob(folder.name + ".tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        tmp.mkdir()
        try:
            report = train(tmp)
            (tmp / DONE_MARKER).write_text(json.dumps(report, indent=2, default=str))
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


@contextlib.contextmanager
def training(threads: int = 1) -> Iterator[None]:
    """What makes a toy's training reproducible: `threads` torch threads (a fixed reduction order)
    and `torch.use_deterministic_algorithms` (an op without a deterministic kernel fails rather than
    varying), both restored afterwards. Seeds are each recipe's own. Measured: two trainings of each
    `:small` toy in separate processes gave byte-identical `model.safetensors` on this machine
    (tests/test_shipped_models.py rebuilds one and compares it with the shipped file)."""
    import torch

    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def ready_folder(name: str, size: str, recipe: dict[str, Any], train: Callable[[Path], dict[str, Any]]) -> Path:
    """The folder a toy loads from: its shipped copy (`probes.toys.shipped`) when that verifies against
    `recipe`, else the user-cache folder, trained there once by `train(tmp_folder) -> report`."""
    shipped = shipped_folder(name, size, recipe)
    if shipped is not None:
        return shipped
    return train_once(toy_folder(name, size, recipe), train)


def shipped_folder(name: str, size: str, recipe: dict[str, Any]) -> Path | None:
    return verified(name if size == "full" else f"{name}:{size}", recipe_hash(recipe))


def read_folder(name: str, size: str, recipe: dict[str, Any]) -> Path:
    """Where a toy's weights and training report are read from (the shipped copy if it verifies)."""
    return shipped_folder(name, size, recipe) or toy_folder(name, size, recipe)


def training_report(folder: Path) -> dict[str, Any]:
    """What the training run wrote about itself (steps, seconds, held-out accuracy)."""
    try:
        return json.loads((folder / DONE_MARKER).read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{folder} holds no training report: {err}") from err


def word_tokenizer(words: Sequence[str], specials: Sequence[str] = SPECIALS, chat_template: str | None = None):
    """A `PreTrainedTokenizerFast` over a fixed word list: whitespace-split words, one id each.

    Decoding joins tokens with single spaces, so a trace's text is its words separated by spaces.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for w in [*specials, *words]:
        vocab.setdefault(w, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>")
    if chat_template:
        tok.chat_template = chat_template
    return tok


def apply_op(a: int, op: str, b: int) -> int:
    """One step of a chained problem: `+` or `-`."""
    return a + b if op == "+" else a - b


@dataclass(frozen=True)
class ChainProblem:
    """`start op1 b1 op2 b2 ...`, evaluated left to right; each toy adds its own prompt and trace.

    >>> p = ChainProblem(12, (("+", 7), ("-", 5)))
    >>> p.values, p.answer, p.question
    ([19, 14], 14, '12 + 7 - 5 = ?')
    """

    start: int
    ops: tuple[tuple[str, int], ...]

    @property
    def values(self) -> list[int]:
        """The running value after each operation; the last is the answer."""
        out, value = [], self.start
        for op, b in self.ops:
            value = apply_op(value, op, b)
            out.append(value)
        return out

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def question(self) -> str:
        """The user turn of a chat prompt: "12 + 7 - 5 = ?"."""
        return " ".join([str(self.start), *(f"{op} {b}" for op, b in self.ops), "= ?"])

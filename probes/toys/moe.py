"""toy-moe: a fine-grained mixture-of-experts model trained here on verifiable multi-step arithmetic.

The model organism for router analyses and Expert-Sample (METHODS.md, method 6): a real
`Qwen3MoeForCausalLM` (64 experts of width 32 per layer, top-8, `norm_topk_prob` as in Qwen3-30B-A3B),
so every router site, rule and figure that works on it works on `hf:` Qwen3-MoE models too. It is
trained from random init, on first use, until greedy accuracy on held-out problems sits well below
100% (the training report records where it stopped), so sampling, token temperature or Expert-Sample,
has errors to fix.

The task: left-to-right evaluation of 3-4 operand additions and subtractions, with a worked trace
(one line per operation) and a final answer the verifier reads:

    Q : 12 + 7 - 5 + 9 = ? A :  12 + 7 = 19 , 19 - 5 = 14 , 14 + 9 = 23 . answer 23 <eos>

`Problem` is one problem (its `prompt`, `trace`, `answer`), `problems(split, n)` draws a split
(`train`, `dev`, `eval`: disjoint by a hash of the problem), `is_correct(text, problem)` verifies a
generation. The tokenizer's chat template renders a user turn holding `problem.question` to exactly
`problem.prompt`, so `chat=True` prompts work. Our recipe, not a published one; the DESIGN.md
feasibility run (3 layers, width 128, 64 experts, top-8) fixed its shape.

Example:
    >>> p = problems("eval", 1)[0]
    >>> p.prompt.startswith("Q : ") and p.prompt.endswith(" = ? A :")
    True
    >>> is_correct(p.trace, p), is_correct(" 1 + 1 = 2 . answer 2", Problem(1, (("+", 1), ("+", 1))))
    (True, False)
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from thoughtscope import checks
from thoughtscope.errors import BadInputError, UnknownModelError
from probes.toys.common import ChainProblem, read_folder, ready_folder, training, training_report, word_tokenizer

log = logging.getLogger(__name__)

NAME = "toy-moe"
# Part of the cache key: bump when the task, the trace format or the recipe changes.
GENERATOR_VERSION = 1

PROMPT_START = "Q :"
PROMPT_END = "A :"
STEP_SEPARATOR = ","
TRACE_END = "."
ANSWER_WORD = "answer"
SPLITS = {"train": (0, 80), "dev": (80, 90), "eval": (90, 100)}  # percent buckets of a problem's hash

# The user turn is the question; the template wraps it in the prompt format, so a chat prompt gives
# exactly the ids of `Problem.prompt`. System turns are dropped: the model never saw one.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ 'Q : ' + m['content'] + ' ' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ 'A : ' + m['content'] + ' <eos> ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'A :' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TaskConfig:
    """Operands in [1, max_operand], min_ops..max_ops operations (+ or -), every running value in
    [0, max_value] (numbers up to max_value are single tokens)."""

    max_operand: int = 30
    min_ops: int = 2
    max_ops: int = 3
    max_value: int = 99


@dataclass(frozen=True)
class Problem(ChainProblem):
    """A chained problem with toy-moe's prompt and worked trace."""

    @property
    def prompt(self) -> str:
        return f"{PROMPT_START} {self.question} {PROMPT_END}"

    @property
    def trace(self) -> str:
        """The worked continuation as the model writes it (decoded text starts with a space)."""
        steps, a = [], self.start
        for (op, b), value in zip(self.ops, self.values):
            steps.append(f"{a} {op} {b} = {value}")
            a = value
        return f" {f' {STEP_SEPARATOR} '.join(steps)} {TRACE_END} {ANSWER_WORD} {self.answer}"

    @property
    def split(self) -> str:
        bucket = int(hashlib.sha256(self.question.encode()).hexdigest()[:8], 16) % 100
        return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "prompt": self.prompt, "trace": self.trace, "answer": self.answer,
                "split": self.split}


def sample_problem(rng: random.Random, config: TaskConfig) -> Problem:
    """A problem whose running values all stay in [0, max_value] (rejection sampling)."""
    while True:
        start = rng.randint(1, config.max_operand)
        ops = tuple((rng.choice("+-"), rng.randint(1, config.max_operand))
                    for _ in range(rng.randint(config.min_ops, config.max_ops)))
        problem = Problem(start, ops)
        if all(0 <= v <= config.max_value for v in problem.values):
            return problem


def iter_problems(split: str = "train", seed: int = 0, config: TaskConfig = TaskConfig()) -> Iterator[Problem]:
    """Endless problems of one split; held-out splits never repeat a problem, train may."""
    if split not in SPLITS:
        raise BadInputError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    rng = random.Random(f"{NAME}/{split}/{seed}")
    seen: set[str] = set()
    while True:
        problem = sample_problem(rng, config)
        if problem.split != split or problem.question in seen:
            continue
        if split != "train":
            seen.add(problem.question)
        yield problem


def problems(split: str, n: int, seed: int = 0, config: TaskConfig | None = None) -> list[Problem]:
    """The first `n` problems of a split (a prefix of any longer draw with the same seed).

    `config` defaults to the full model's task; use `task_config(size)` for the problems a size saw.
    """
    checks.integer("n", n, low=0, why="a non-negative count")
    return list(islice(iter_problems(split, seed, config or TaskConfig()), n))


_ANSWER = re.compile(rf"\b{ANSWER_WORD} (-?\d+)")


def parse_answer(text: str) -> int | None:
    """The number after the first "answer" in a generation, or None.

    >>> parse_answer(" 3 + 4 = 7 . answer 7 <eos>")
    7
    """
    match = _ANSWER.search(text)
    return int(match.group(1)) if match else None


def is_correct(text: str, problem: Problem) -> bool:
    """The verifier: the generation's final answer equals the problem's."""
    return parse_answer(text) == problem.answer


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelConfig:
    """The `Qwen3MoeForCausalLM` and its training schedule (a fixed number of steps: deterministic)."""

    layers: int = 3
    width: int = 128
    heads: int = 4
    kv_heads: int = 2
    experts: int = 64
    top_k: int = 8
    expert_width: int = 32
    context: int = 64
    # 500 steps of 64 problems leave greedy accuracy on held-out problems at 0.79 (dev, 300 problems);
    # 1000 steps reached 0.93, too close to 100% for sampling to matter (measured here, one thread)
    steps: int = 500
    batch: int = 64
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    router_aux_loss: float = 0.01  # load balancing keeps all 64 experts in use, so the tail is real
    seed: int = 0
    eval_problems: int = 300  # held-out (dev split) greedy accuracy in the training report


SIZES: dict[str, tuple[ModelConfig, TaskConfig]] = {
    "full": (ModelConfig(), TaskConfig()),
    # For tests: trains in well under a minute; the same classes, trace format and router shape.
    "small": (ModelConfig(layers=2, width=64, experts=32, top_k=4, expert_width=16, steps=300, batch=32,
                          warmup=30, eval_problems=100),
              TaskConfig(max_operand=9, min_ops=2, max_ops=2, max_value=30)),
}


def task_config(size: str = "full") -> TaskConfig:
    """The problems a size was trained on (draw held-out problems with the same config)."""
    return _size(size)[1]


def _size(size: str) -> tuple[ModelConfig, TaskConfig]:
    if size not in SIZES:
        raise UnknownModelError(f"{NAME} comes in sizes {', '.join(SIZES)}, not {size!r}")
    return SIZES[size]


def vocabulary(config: TaskConfig) -> list[str]:
    words = [*PROMPT_START.split(), *PROMPT_END.split(), "=", "?", "+", "-", STEP_SEPARATOR, TRACE_END, ANSWER_WORD]
    return [*words, *(str(i) for i in range(config.max_value + 1))]


def build_tokenizer(config: TaskConfig):
    """Word-level: every number up to max_value is one token; the chat template gives the prompt format."""
    return word_tokenizer(vocabulary(config), chat_template=CHAT_TEMPLATE)


def build_model(mc: ModelConfig, tok: Any):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=mc.width, intermediate_size=4 * mc.width, num_hidden_layers=mc.layers,
        num_attention_heads=mc.heads, num_key_value_heads=mc.kv_heads, head_dim=mc.width // mc.heads,
        num_experts=mc.experts, num_experts_per_tok=mc.top_k, moe_intermediate_size=mc.expert_width,
        norm_topk_prob=True, router_aux_loss_coef=mc.router_aux_loss, max_position_embeddings=mc.context,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(mc.seed)
    model = Qwen3MoeForCausalLM(config)
    # grouped_mm (transformers' default): a training step took half the CPU time of "eager" here
    model.set_experts_implementation("grouped_mm")
    return model


def training_sequence(problem: Problem, vocab: dict[str, int], eos_id: int) -> tuple[list[int], int]:
    """Token ids of prompt + trace + eos, and the prompt length (the loss skips the prompt)."""
    prompt = [vocab[w] for w in problem.prompt.split()]
    return prompt + [vocab[w] for w in problem.trace.split()] + [eos_id], len(prompt)


def _batch(seqs: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for b, (ids, n_prompt) in enumerate(seqs):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        mask[b, :len(ids)] = 1
        labels[b, n_prompt:len(ids)] = torch.tensor(ids[n_prompt:])
    return input_ids, mask, labels


def train(folder: Path | None, size: str = "full", progress: bool = True,
          on_eval: Any = None, eval_every: int = 0, on_progress: Any = None) -> dict[str, Any]:
    """Train the model of `size` into `folder` (safetensors + tokenizer) and return its report.

    Training runs on one CPU thread: the same weights on any machine (reductions keep their order),
    and no thread thrashing on a shared machine (two threads on two busy cores ran 5-10x slower here).
    `eval_every` > 0 calls `on_eval(step, seconds, dev_accuracy)` during training (exploration only:
    greedy decoding draws no random numbers, so it does not change the weights).
    `on_progress(done, total, message)` is called after every step, then once before the evaluation.
    """
    with training(1):  # one thread and deterministic algorithms (probes.toys.common.training)
        return _train(folder, size, progress, on_eval, eval_every, on_progress)


def _train(folder: Path | None, size: str, progress: bool, on_eval: Any, eval_every: int,
           on_progress: Any = None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    mc, tc = _size(size)
    torch.manual_seed(mc.seed)
    tok = build_tokenizer(tc)
    vocab = tok.get_vocab()
    model = build_model(mc, tok)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=mc.lr, weight_decay=mc.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warmup, then cosine decay to a tenth
        if step < mc.warmup:
            return (step + 1) / mc.warmup
        frac = (step - mc.warmup) / max(1, mc.steps - mc.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    data = iter_problems("train", mc.seed, tc)
    dev = problems("dev", mc.eval_problems, seed=mc.seed, config=tc)
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(mc.steps), desc=f"training {NAME}:{size}", disable=not progress, unit="step")
    for step in bar:
        seqs = [training_sequence(p, vocab, tok.eos_token_id) for p in islice(data, mc.batch)]
        input_ids, mask, labels = _batch(seqs, tok.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels, output_router_logits=True).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if on_progress is not None:
            on_progress(step + 1, mc.steps, f"training {NAME}:{size}")
        if eval_every and on_eval is not None and (step + 1) % eval_every == 0:
            model.eval()
            on_eval(step + 1, time.perf_counter() - t0, greedy_accuracy(model, tok, dev))
            model.train()
    seconds = time.perf_counter() - t0
    bar.close()
    model.eval()
    if on_progress is not None:
        on_progress(mc.steps, mc.steps, f"evaluating {NAME}:{size} on held-out problems")
    texts = greedy_continuations(model, tok, [p.prompt for p in dev])
    report: dict[str, Any] = {
        "model": NAME, "size": size, "generator_version": GENERATOR_VERSION,
        "model_config": asdict(mc), "task_config": asdict(tc),
        "steps": mc.steps, "batch": mc.batch, "seconds": round(seconds, 1),
        "examples_per_second": round(mc.steps * mc.batch / seconds, 1), "torch_threads": torch.get_num_threads(),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "heldout_split": "dev", "heldout_n": len(dev),
        "greedy_accuracy": round(sum(is_correct(t, p) for t, p in zip(texts, dev)) / len(dev), 4),
    }
    if folder is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(folder)  # safetensors
        tok.save_pretrained(folder)
    return report


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def greedy_continuations(model: Any, tok: Any, prompts: Sequence[str], max_new_tokens: int = 40,
                         batch: int = 100) -> list[str]:
    """Greedy continuations (decoded as the engine decodes: a space before each word), by a plain
    KV-cached loop over left-padded batches. Used by training, where no engine exists yet."""
    from transformers import DynamicCache

    vocab = tok.get_vocab()
    texts: list[str] = []
    for lo in range(0, len(prompts), batch):
        ids = [[vocab.get(w, tok.unk_token_id) for w in p.split()] for p in prompts[lo:lo + batch]]
        width = max(map(len, ids))
        feed = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for b, row in enumerate(ids):
            feed[b, width - len(row):] = torch.tensor(row)
            mask[b, width - len(row):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out: list[list[int]] = [[] for _ in ids]
        done = torch.zeros(len(ids), dtype=torch.bool)
        for _ in range(max_new_tokens):
            logits = model(input_ids=feed, attention_mask=mask, position_ids=positions, use_cache=True,
                           logits_to_keep=1, **{cache_kw: cache}).logits[:, -1]
            nxt = logits.argmax(-1)
            for b in range(len(ids)):
                if not done[b]:
                    out[b].append(int(nxt[b]))
            done |= nxt == tok.eos_token_id
            if bool(done.all()):
                break
            feed = nxt.view(-1, 1)
            mask = torch.cat([mask, torch.ones(len(ids), 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
        texts += ["".join(" " + tok.convert_ids_to_tokens(i) for i in row if i != tok.eos_token_id) for row in out]
    return texts


def greedy_accuracy(model: Any, tok: Any, held_out: Sequence[Problem]) -> float:
    texts = greedy_continuations(model, tok, [p.prompt for p in held_out])
    return sum(is_correct(t, p) for t, p in zip(texts, held_out)) / max(len(held_out), 1)


# ----------------------------------------------------------------------------- the zoo's entry point


def recipe(size: str) -> dict[str, Any]:
    """Everything that decides the weights: the cache folder is named by its hash."""
    mc, tc = _size(size)
    return {"name": NAME, "generator_version": GENERATOR_VERSION, "model": asdict(mc), "task": asdict(tc),
            "splits": SPLITS}


def folder_for(size: str = "full") -> Path:
    """Where a size's weights and training report are read from: the shipped copy
    (`docs/shipped/models`) when it verifies against this recipe, else the user-cache folder."""
    return read_folder(NAME, size, recipe(size))


def report(size: str = "full") -> dict[str, Any]:
    """The training report of a trained size (steps, seconds, held-out greedy accuracy)."""
    return training_report(folder_for(size))


def train_into(size: str, folder: Path, on_progress: Any = None, progress: bool = True) -> dict[str, Any]:
    """Train a size from scratch into `folder` and return its training report (the zoo's and
    `thoughtscope models ship`'s one way to train it)."""
    return train(folder, size, progress=progress, on_progress=on_progress)


def load(size: str = "full", dtype: torch.dtype = torch.float32, on_progress: Any = None):
    """The trained model (shipped, or trained and cached on first use) and its tokenizer."""
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    def _train(tmp: Path) -> dict[str, Any]:
        log.warning("thoughtscope: training %s:%s once (%s); cached afterwards", NAME, size,
                    "a few minutes on a quiet CPU" if size == "full" else "under a minute")
        return train_into(size, tmp, on_progress=on_progress)

    folder = ready_folder(NAME, size, recipe(size), _train)
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok

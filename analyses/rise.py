"""RISE: reasoning behaviours as directions in step-level SAEs (Zhang et al., "Fantastic Reasoning
Behaviors and Where to Find Them", arXiv 2512.23988; no official code).

The model writes chain-of-thought traces; each trace is cut into steps, and one teacher-forced
pass reads the residual stream at the token that closes each step, so every step becomes one
vector. An SAE trained on those vectors, with no labels, turns out to hold columns for behaviours
such as reflection and backtracking; their mean decoder direction steers the behaviour.

Pipeline (what is [summary] from a write-up of the paper, what is our [recon]):
1. `harvest`: traces for a problem set, steps split at "\\n\\n" [summary] or, for the embedded
   SmolLM2 whose short traces rarely hold blank lines, at sentence ends [recon]; one batched
   teacher-forced pass per batch of traces reads `resid_post.L` at each step's closing token
   [summary]. Stored in `cache/` per trace, so an interrupted harvest resumes. Optional
   `augment="templated"` splices generic reflection/backtracking sentences into the traces of
   models too small to produce them [recon].
2. SAEs per layer (`saes.train`, SAELens) [summary].
3. `label_step`: keyword labeller [summary], or any judge callable; labels colour and evaluate,
   they never train.
4. `associate_columns`: each labelled step's argmax latent votes for its label; the most voted
   columns form the label's column set [summary]; vote thresholds are ours [recon].
5. `decoder_geometry`: UMAP (cosine) of decoder columns, silhouette of the behaviour groups per
   layer [summary]; silhouette computed on the decoder columns with the cosine metric, and also
   on the 2-D map [recon].
6. `behaviour_vectors`: mean of a behaviour's columns after dropping columns shared with other
   labels, renormalised [summary].
7. `steer`: h' = h - alpha w (w.h) at every generated token, or h + c w [summary].
8. `confidence_vectors`: coefficients over all decoder columns that minimise next-token entropy
   when their combination is added at the layer (model frozen; Adam lr 0.01, cosine) [summary];
   added at generated positions only, no regulariser, few iterations on a CPU [recon].
9. `feature_dashboard`: per latent, top steps, activation histogram, tokens promoted and
   suppressed through the unembedding, label frequencies (SAEDashboard-style) [recon].
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from analyses.tasks import SYSTEM_PROMPT, Problem, cot_prompt, is_correct, one_shot_messages
from thoughtscope.errors import BadInputError

BEHAVIOURS = ("reflection", "backtracking")
OTHER = "other"
LABELS = (*BEHAVIOURS, OTHER)

# METHODS.md section 1, item 5 [summary].
REFLECTION_KEYWORDS = ("wait", "verify", "make sure", "hold on", "think again", "let me check",
                       "seems right", "'s correct", "'s incorrect")
BACKTRACKING_KEYWORDS = ("alternatively", "think differently", "another way", "another approach",
                         "another method", "another solution", "another strategy")
SENTENCE = "sentence"
PARAGRAPH = "\n\n"
# Models whose traces are short and rarely hold blank lines (DESIGN.md): split at sentence ends.
SENTENCE_MODELS = ("smollm2-135m", "tiny-random:")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")

Judge = Callable[[str], "str | None"]


# --------------------------------------------------------------------------- steps


@dataclass
class Step:
    """One reasoning step: its text, its character span in the trace (delimiter included), and the
    index (into the trace's generated tokens) of the token that closes it."""

    index: int
    text: str
    start: int
    end: int
    token: int = -1
    closed: bool = True  # False for a trailing fragment without a delimiter
    label: str = OTHER

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_delimiter(delimiter: str, model_id: str = "") -> str:
    """`auto` -> sentence ends for the embedded and tiny models, the paragraph delimiter otherwise."""
    if delimiter == "auto":
        return SENTENCE if any(model_id.startswith(m) for m in SENTENCE_MODELS) else PARAGRAPH
    if not delimiter:
        raise BadInputError("the step delimiter is empty; use 'auto', 'sentence' or a string such as '\\n\\n'")
    return delimiter.encode().decode("unicode_escape") if "\\" in delimiter else delimiter


def segment_steps(text: str, delimiter: str = PARAGRAPH, include_tail: bool = True) -> list[Step]:
    """Cut `text` into steps that end with `delimiter` (a literal string, or `sentence`).

    Whitespace-only pieces are not steps. A trailing piece without a delimiter is a step with
    `closed=False` when `include_tail`.

    >>> [(s.text, s.end) for s in segment_steps("We add. So 2.5 + 1 = 3.5! Done", "sentence")]
    [('We add.', 7), ('So 2.5 + 1 = 3.5!', 25), ('Done', 30)]
    """
    if delimiter == SENTENCE:
        ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    else:
        ends, at = [], text.find(delimiter)
        while at >= 0:
            ends.append(at + len(delimiter))
            at = text.find(delimiter, at + len(delimiter))
    steps: list[Step] = []
    start = 0
    for end in ends:
        if text[start:end].strip() and text[start:end].strip() != delimiter.strip():
            steps.append(Step(len(steps), text[start:end].strip(), start, end))
        start = end
    if include_tail and text[start:].strip():
        steps.append(Step(len(steps), text[start:].strip(), start, len(text), closed=False))
    return steps


def locate_step_tokens(pieces: Sequence[str], steps: list[Step]) -> list[Step]:
    """Set each step's `token`: the token holding its last character (for a closed step, the
    delimiter's last character; for a tail, its last non-space character). `pieces` are the
    generated tokens' texts, which concatenate to the trace text."""
    ends = np.cumsum([len(p) for p in pieces]) if pieces else np.zeros(0, dtype=int)
    text = "".join(pieces)
    for step in steps:
        last = step.end - 1
        if not step.closed:
            while last > step.start and text[last].isspace():
                last -= 1
        # The first token whose end is past `last` contains it.
        step.token = int(np.searchsorted(ends, last, side="right"))
        if step.token >= len(pieces):
            raise BadInputError(f"step {step.index} ends at character {step.end}, beyond the {len(text)}-character trace")
    return steps


# --------------------------------------------------------------------------- labels


def _keyword_pattern(words: Sequence[str]) -> re.Pattern[str]:
    parts = [(r"\b" if w[0].isalnum() else "") + re.escape(w) + r"\b" for w in words]
    return re.compile("|".join(parts))


_REFLECTION_RE = _keyword_pattern(REFLECTION_KEYWORDS)
_BACKTRACKING_RE = _keyword_pattern(BACKTRACKING_KEYWORDS)


def label_step(text: str, judge: Judge | None = None) -> str:
    """`reflection`, `backtracking` or `other`: the judge's answer when it gives one, else keywords.

    With keywords of both kinds the one that comes first wins [recon].

    >>> label_step("Wait, let me check: 17 - 8 = 9."), label_step("Alternatively, count on."), label_step("So 9 + 8 = 17.")
    ('reflection', 'backtracking', 'other')
    """
    if judge is not None:
        verdict = judge(text)
        if verdict is not None:
            if verdict not in LABELS:
                raise BadInputError(f"the judge answered {verdict!r}; it must answer one of {LABELS} or None")
            return verdict
    low = text.lower().replace("\u2019", "'")
    hits = [(m.start(), label) for label, rx in (("reflection", _REFLECTION_RE), ("backtracking", _BACKTRACKING_RE))
            if (m := rx.search(low))]
    return min(hits)[1] if hits else OTHER


def count_behaviours(text: str, delimiter: str) -> dict[str, int]:
    """Steps of each label in a trace: the quantity steering moves."""
    counts = Counter(label_step(s.text) for s in segment_steps(text, delimiter))
    return {label: counts.get(label, 0) for label in LABELS}


# --------------------------------------------------------------------------- harvest


@dataclass
class HarvestSettings:
    """How traces are made and cut. `prompt`: `one-shot` (tasks.one_shot_messages, chat),
    `cot` (tasks.cot_prompt, plain text) or `chat` (the question as one user turn)."""

    layers: tuple[int, ...] = (15,)
    max_new_tokens: int = 96
    batch_size: int = 16
    delimiter: str = "auto"
    prompt: str = "one-shot"
    system: str = SYSTEM_PROMPT
    augment: str = "none"  # or "templated" [recon]
    seed: int = 0

    def validate(self, n_layers: int) -> None:
        if not self.layers:
            raise BadInputError("choose at least one layer, e.g. --layers 15")
        bad = [layer for layer in self.layers if not 0 <= layer < n_layers]
        if bad:
            raise BadInputError(f"layers {bad} out of range; this model has layers 0..{n_layers - 1}")
        if self.prompt not in ("one-shot", "cot", "chat"):
            raise BadInputError(f"prompt {self.prompt!r}; use one-shot, cot or chat")
        if self.augment not in ("none", "templated"):
            raise BadInputError(f"augment {self.augment!r}; use none or templated")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise BadInputError("batch_size and max_new_tokens must be positive")

    @property
    def sites(self) -> list[str]:
        return [f"resid_post.{layer}" for layer in self.layers]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TraceRecord:
    """One generated trace: problem, text, tokens, steps (labelled), correctness."""

    problem: Problem
    text: str
    prompt_ids: list[int]
    gen_ids: list[int]
    pieces: list[str]
    steps: list[Step]
    correct: bool
    augmented: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.gen_ids)

    def to_dict(self) -> dict[str, Any]:
        return {"problem_id": self.problem.id, "question": self.problem.question, "answer": self.problem.answer,
                "text": self.text, "n_tokens": self.n_tokens, "correct": self.correct, "augmented": self.augmented,
                "steps": [s.to_dict() for s in self.steps]}


@dataclass
class Harvest:
    """Step vectors of a problem set: `acts[site]` is [n_steps, d_model], rows in `step_rows` order."""

    model_id: str
    settings: HarvestSettings
    delimiter: str
    traces: list[TraceRecord]
    acts: dict[str, torch.Tensor]
    step_rows: list[tuple[int, int]]  # (trace index, step index) per row
    generation_seconds: float = 0.0
    harvest_seconds: float = 0.0
    n_from_cache: int = 0

    def step(self, row: int) -> Step:
        t, s = self.step_rows[row]
        return self.traces[t].steps[s]

    @property
    def labels(self) -> list[str]:
        return [self.step(r).label for r in range(len(self.step_rows))]

    def label_counts(self) -> dict[str, int]:
        counts = Counter(self.labels)
        return {label: counts.get(label, 0) for label in LABELS}

    def to_dict(self, with_traces: bool = False) -> dict[str, Any]:
        out = {
            "model_id": self.model_id, "settings": self.settings.to_dict(), "delimiter": self.delimiter,
            "n_traces": len(self.traces), "n_steps": len(self.step_rows),
            "n_augmented": sum(t.augmented for t in self.traces),
            "accuracy": float(np.mean([t.correct for t in self.traces])) if self.traces else None,
            "mean_tokens": float(np.mean([t.n_tokens for t in self.traces])) if self.traces else None,
            "mean_steps": len(self.step_rows) / max(1, len(self.traces)),
            "label_counts": self.label_counts(),
            "sites": {k: list(v.shape) for k, v in self.acts.items()},
            "generation_seconds": self.generation_seconds, "harvest_seconds": self.harvest_seconds,
            "n_from_cache": self.n_from_cache,
        }
        if with_traces:
            out["traces"] = [t.to_dict() for t in self.traces]
        return out


def build_prompt(problem: Problem, settings: HarvestSettings) -> tuple[Any, bool]:
    """(prompt, chat) for the engine."""
    if settings.prompt == "one-shot":
        return one_shot_messages(problem, system=settings.system), True
    if settings.prompt == "cot":
        return cot_prompt(problem), False
    return [{"role": "user", "content": f"{problem.question}\nPlease reason step by step."}], True


def harvest(engine: Any, problems: Sequence[Problem], settings: HarvestSettings | None = None,
            store: Any = None, judge: Judge | None = None, progress: bool = True) -> Harvest:
    """Generate, cut, label and read step vectors for `problems`; reuse and fill `store` (resumable).

    Each batch is stored as soon as it is done, so a rerun after an interruption only computes
    what is missing; changing the layers reuses the stored traces and reruns only the reading pass.
    """
    from tqdm.auto import tqdm

    settings = settings or HarvestSettings()
    info = engine.info()
    settings.validate(info["arch"]["n_layers"])
    if not problems:
        raise BadInputError("no problems to harvest; ask for n >= 1")
    delimiter = resolve_delimiter(settings.delimiter, info["model_id"])
    keys = _StoreKeys(info["fingerprint"], settings, delimiter)
    traces: list[TraceRecord | None] = [None] * len(problems)
    vectors: list[dict[str, torch.Tensor] | None] = [None] * len(problems)
    gen_s = read_s = 0.0
    from_cache = 0
    bar = tqdm(total=len(problems), desc="RISE harvest", unit="trace", disable=not progress)
    for lo in range(0, len(problems), settings.batch_size):
        batch = list(range(lo, min(lo + settings.batch_size, len(problems))))
        todo_gen = []
        for i in batch:
            traces[i], vectors[i] = _load_cached(store, keys, problems[i], settings)
            from_cache += vectors[i] is not None
            if traces[i] is None:
                todo_gen.append(i)
        if todo_gen:
            started = time.perf_counter()
            made = generate_traces(engine, [problems[i] for i in todo_gen], settings, delimiter)
            gen_s += time.perf_counter() - started
            for i, trace in zip(todo_gen, made):
                traces[i] = trace
                _store_trace(store, keys, trace)
        if settings.augment == "templated":
            for i in batch:
                if vectors[i] is None and not traces[i].augmented:
                    traces[i] = augment_trace(engine, traces[i], delimiter, seed=settings.seed * 100_003 + i)
        todo_read = [i for i in batch if vectors[i] is None]
        if todo_read:
            started = time.perf_counter()
            read = step_residuals(engine, [traces[i].prompt_ids + traces[i].gen_ids for i in todo_read],
                                  [[len(traces[i].prompt_ids) + s.token for s in traces[i].steps] for i in todo_read],
                                  settings.layers, batch_size=settings.batch_size)
            read_s += time.perf_counter() - started
            for i, acts in zip(todo_read, read):
                vectors[i] = acts
                _store_vectors(store, keys, traces[i], acts)
        bar.update(len(batch))
    bar.close()
    for trace in traces:
        for step in trace.steps:
            step.label = label_step(step.text, judge)
    acts = {site: torch.cat([v[site] for v in vectors]) for site in settings.sites}
    rows = [(t, s) for t, trace in enumerate(traces) for s in range(len(trace.steps))]
    return Harvest(info["model_id"], settings, delimiter, list(traces), acts, rows, gen_s, read_s, from_cache)


def generate_traces(engine: Any, problems: Sequence[Problem], settings: HarvestSettings, delimiter: str,
                    interventions: Sequence[Any] = ()) -> list[TraceRecord]:
    """One batched greedy generation; each trace cut into steps located on its tokens."""
    prompts, chats = zip(*(build_prompt(p, settings) for p in problems))
    chat = chats[0]
    prompt_ids = [engine.encode(p, chat=chat) for p in prompts]
    eos = set(getattr(engine, "eos_ids", ()))
    ids: list[list[int]] = [[] for _ in problems]
    pieces: list[list[str]] = [[] for _ in problems]
    for rec in engine.generate(prompts=list(prompts), max_new_tokens=settings.max_new_tokens, chat=chat,
                               interventions=interventions):
        if rec.token_id in eos:
            continue
        ids[rec.batch_index].append(rec.token_id)
        pieces[rec.batch_index].append(rec.text)
    return [_make_trace(p, pids, gids, pcs, delimiter) for p, pids, gids, pcs in zip(problems, prompt_ids, ids, pieces)]


def _make_trace(problem: Problem, prompt_ids: list[int], gen_ids: list[int], pieces: list[str], delimiter: str,
                augmented: bool = False) -> TraceRecord:
    text = "".join(pieces)
    steps = locate_step_tokens(pieces, segment_steps(text, delimiter))
    return TraceRecord(problem, text, list(prompt_ids), list(gen_ids), list(pieces), steps,
                       is_correct(text, problem), augmented)


# Generic sentences spliced into traces of models too small to reflect or backtrack [recon].
REFLECTION_TEMPLATES = (
    "Wait, let me check that again.", "Let me verify this step.", "Hold on, let me make sure that is right.",
    "Let me check: that seems right.", "Wait, I should think again about this.", "Let me make sure the numbers add up.",
)
BACKTRACKING_TEMPLATES = (
    "Alternatively, I can think differently about it.", "Another way to see this is to count on.",
    "Alternatively, let me try another approach.", "Let me use another method to solve it.",
    "Alternatively, there is another way to find the total.",
)


def augment_trace(engine: Any, trace: TraceRecord, delimiter: str, seed: int = 0) -> TraceRecord:
    """Splice one templated reflection or backtracking sentence after a random step [recon].

    Only the embedded-model demo needs this: a 135M model never reflects on its own, so without
    it the labels have nothing to colour. The SAE still trains without labels.
    """
    if not trace.steps:
        return trace
    rng = random.Random(seed)
    template = rng.choice(REFLECTION_TEMPLATES if rng.random() < 0.5 else BACKTRACKING_TEMPLATES)
    # After a closed step (or at the start), so the template is a step of its own.
    cut = rng.choice([0] + [s.end for s in trace.steps if s.closed])
    joiner = delimiter if delimiter != SENTENCE else " "
    head, rest = trace.text[:cut].rstrip(), trace.text[cut:].lstrip()
    text = (head + joiner if head else " ") + template + (joiner + rest if rest else "")
    gen_ids = engine.tok(text, add_special_tokens=False)["input_ids"]
    return _make_trace(trace.problem, trace.prompt_ids, gen_ids, _pieces(engine.tok, gen_ids), delimiter, augmented=True)


def _pieces(tok: Any, ids: list[int]) -> list[str]:
    """Per-token texts that concatenate to the decoded text (multi-byte characters stay whole)."""
    out, before = [], ""
    for i in range(len(ids)):
        now = tok.decode(ids[: i + 1])
        out.append(now[len(before):])
        before = now
    return out


@torch.no_grad()
def step_residuals(engine: Any, sequences: Sequence[list[int]], positions: Sequence[list[int]],
                   layers: Sequence[int], batch_size: int = 16) -> list[dict[str, torch.Tensor]]:
    """`resid_post.L` at `positions` of each token sequence: {site: [len(positions), d]} per sequence.

    One batched teacher-forced pass per `batch_size` sequences (`Engine.capture_batch`). The prefix
    all sequences share (the one-shot example, the system prompt) runs once and its KV cache is
    reused; the pass stops after the deepest layer asked for and computes no logits. Backends
    other than the in-process engine fall back to one `trace` per sequence.
    """
    sites = [f"resid_post.{layer}" for layer in layers]
    if not hasattr(engine, "capture_batch") or getattr(engine.handle, "remote", False):
        return [{s: engine.trace(list(ids), capture=sites).activations[s][list(pos)].float().cpu() for s in sites}
                for ids, pos in zip(sequences, positions)]
    shared = _shared_prefix(sequences, positions)
    prefix = engine.prefill(list(sequences[0][:shared])) if shared >= 8 else None
    shared = shared if prefix is not None else 0
    out: list[dict[str, torch.Tensor]] = []
    for lo in range(0, len(sequences), batch_size):
        chunk = range(lo, min(lo + batch_size, len(sequences)))
        captured = engine.capture_batch([sequences[i] for i in chunk], sites, prefix=prefix)
        for b, i in enumerate(chunk):
            rows = torch.tensor([p - shared for p in positions[i]], dtype=torch.long)
            out.append({s: captured[s][b, rows].float().cpu() for s in sites})
    return out


def _shared_prefix(sequences: Sequence[list[int]], positions: Sequence[list[int]]) -> int:
    """Length of the common token prefix, short of every position to be read."""
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for seq in sequences[1:]:
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    wanted = [p for pos in positions for p in pos]
    return min([n, *wanted]) if wanted else n


# ----- storage: one entry per trace (tokens, text) and one per (trace, layers) (step vectors)


@dataclass
class _StoreKeys:
    fingerprint: str
    settings: HarvestSettings
    delimiter: str

    def trace_settings(self) -> dict[str, Any]:
        s = self.settings
        return {"kind": "rise-trace/v1", "max_new_tokens": s.max_new_tokens, "prompt": s.prompt,
                "system": s.system, "sampling": "greedy"}

    def vector_settings(self) -> dict[str, Any]:
        return {**self.trace_settings(), "kind": "rise-steps/v1", "delimiter": self.delimiter,
                "augment": self.settings.augment, "seed": self.settings.seed}

    @staticmethod
    def prompt(problem: Problem) -> str:
        return json.dumps(problem.to_dict(), sort_keys=True)


def _load_cached(store: Any, keys: _StoreKeys, problem: Problem, settings: HarvestSettings):
    if store is None:
        return None, None
    prompt = keys.prompt(problem)
    entry = store.get(keys.fingerprint, prompt, keys.vector_settings(), settings.sites)
    if entry is not None:
        return _trace_from_meta(problem, entry.meta, keys.delimiter), {s: entry.tensors[s] for s in settings.sites}
    entry = store.get(keys.fingerprint, prompt, keys.trace_settings(), [])
    if entry is None:
        return None, None
    return _trace_from_meta(problem, entry.meta, keys.delimiter), None


def _trace_from_meta(problem: Problem, meta: dict[str, Any], delimiter: str) -> TraceRecord:
    return _make_trace(problem, meta["prompt_ids"], meta["gen_ids"], meta["pieces"], delimiter,
                       augmented=meta.get("augmented", False))


def _trace_meta(trace: TraceRecord) -> dict[str, Any]:
    return {"prompt_ids": trace.prompt_ids, "gen_ids": trace.gen_ids, "pieces": trace.pieces,
            "text": trace.text, "augmented": trace.augmented}


def _store_trace(store: Any, keys: _StoreKeys, trace: TraceRecord) -> None:
    if store is not None:
        store.put(keys.fingerprint, keys.prompt(trace.problem), keys.trace_settings(), [], {}, _trace_meta(trace))


def _store_vectors(store: Any, keys: _StoreKeys, trace: TraceRecord, acts: dict[str, torch.Tensor]) -> None:
    if store is not None:
        store.put(keys.fingerprint, keys.prompt(trace.problem), keys.vector_settings(), keys.settings.sites,
                  {k: v.contiguous() for k, v in acts.items()}, _trace_meta(trace))


# --------------------------------------------------------------------------- columns and geometry


@dataclass
class ColumnAssociation:
    """Argmax-latent votes: `votes[label][column]`, the column sets, and one label per column."""

    votes: dict[str, dict[int, int]]
    column_sets: dict[str, list[int]]
    column_labels: list[str | None]  # the label a column got most votes for, None if no votes

    def to_dict(self) -> dict[str, Any]:
        return {"votes": {k: {str(c): n for c, n in v.items()} for k, v in self.votes.items()},
                "column_sets": self.column_sets,
                "n_labelled_columns": sum(label is not None for label in self.column_labels)}


def associate_columns(latents: torch.Tensor, labels: Sequence[str], top_n: int = 8,
                      min_votes: int = 1) -> ColumnAssociation:
    """Each step votes with its argmax latent for its label; a label's set is its `top_n` most
    voted columns with at least `min_votes` votes. Steps where no latent fires do not vote."""
    latents = torch.as_tensor(latents).float()
    if latents.shape[0] != len(labels):
        raise BadInputError(f"{latents.shape[0]} latent rows but {len(labels)} labels")
    winners = latents.argmax(1).tolist()
    fired = (latents.max(1).values > 0).tolist()
    votes: dict[str, Counter] = {label: Counter() for label in LABELS}
    for col, ok, label in zip(winners, fired, labels):
        if ok:
            votes.setdefault(label, Counter())[col] += 1
    sets = {label: [c for c, n in counter.most_common(top_n) if n >= min_votes] for label, counter in votes.items()}
    column_labels: list[str | None] = [None] * latents.shape[1]
    best = np.zeros(latents.shape[1])
    for label in votes:  # LABELS order: on a tie the behaviour wins over `other`
        for col, n in votes[label].items():
            if n > best[col]:
                best[col], column_labels[col] = n, label
    return ColumnAssociation({k: dict(v) for k, v in votes.items()}, sets, column_labels)


def behaviour_vectors(w_dec: torch.Tensor, column_sets: dict[str, list[int]],
                      behaviours: Sequence[str] = BEHAVIOURS) -> dict[str, torch.Tensor]:
    """Unit vector per behaviour: mean of its decoder rows, leaving out rows in several labels' sets."""
    w_dec = torch.as_tensor(w_dec).detach().float()
    owners = Counter(c for cols in column_sets.values() for c in set(cols))
    vectors = {}
    for label in behaviours:
        own = [c for c in column_sets.get(label, []) if owners[c] == 1]
        if own:
            v = w_dec[own].mean(0)
            if float(v.norm()) > 0:
                vectors[label] = v / v.norm()
    return vectors


def decoder_geometry(w_dec: torch.Tensor, column_labels: Sequence[str | None], method: str = "umap",
                     seed: int = 0, n_neighbors: int = 15) -> tuple[np.ndarray, float | None, float | None]:
    """2-D map of the decoder columns (UMAP, cosine; or PCA) and the silhouette of the labelled
    columns' groups: (coords [d_sae, 2], silhouette on the columns (cosine), silhouette on the map)."""
    w = torch.as_tensor(w_dec).detach().float().numpy()
    coords = _project(w, method, seed, n_neighbors)
    keep = [i for i, label in enumerate(column_labels) if label is not None]
    groups = [column_labels[i] for i in keep]
    return coords, _silhouette(w[keep], groups, "cosine"), _silhouette(coords[keep], groups, "euclidean")


def _project(w: np.ndarray, method: str, seed: int, n_neighbors: int) -> np.ndarray:
    if method not in ("umap", "pca"):
        raise BadInputError(f"projection {method!r}; use umap or pca")
    if method == "umap" and w.shape[0] > 4:
        import warnings

        import umap

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # umap warns that a seed disables parallelism
            reducer = umap.UMAP(n_components=2, metric="cosine", random_state=seed,
                                n_neighbors=max(2, min(n_neighbors, w.shape[0] - 1)), init="random")
            return reducer.fit_transform(w).astype(np.float32)
    centred = w - w.mean(0)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    coords = u[:, :2] * s[:2]
    return np.pad(coords, ((0, 0), (0, 2 - coords.shape[1]))).astype(np.float32)


def _silhouette(x: np.ndarray, groups: Sequence[str], metric: str) -> float | None:
    from sklearn.metrics import silhouette_score

    n_groups = len(set(groups))
    if n_groups < 2 or n_groups > len(groups) - 1:
        return None  # undefined: silhouette needs 2 <= groups <= samples - 1
    return float(silhouette_score(x, list(groups), metric=metric))


# --------------------------------------------------------------------------- per-layer analysis


@dataclass
class LayerAnalysis:
    """One layer: its SAE's quality, column association, geometry and behaviour vectors."""

    site: str
    stats: Any  # saes.stats.SAEStats
    association: ColumnAssociation
    coords: np.ndarray
    silhouette: float | None
    silhouette_map: float | None
    vectors: dict[str, torch.Tensor]
    top_latents: np.ndarray  # [n_steps, k] strongest latents of each step (step timeline)

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "sae": self.stats.to_dict(), "association": self.association.to_dict(),
                "silhouette": self.silhouette, "silhouette_map": self.silhouette_map,
                "behaviour_vectors": sorted(self.vectors),
                "vector_cosines": _cosines(self.vectors)}


def _cosines(vectors: dict[str, torch.Tensor]) -> dict[str, float]:
    names = sorted(vectors)
    return {f"{a}|{b}": float(vectors[a] @ vectors[b]) for i, a in enumerate(names) for b in names[i + 1:]}


@dataclass
class RiseAnalysis:
    layers: list[LayerAnalysis]
    label_counts: dict[str, int]

    @property
    def best_site(self) -> str:
        """The layer whose behaviour groups separate best (the paper steers at such a layer)."""
        scored = [(la.silhouette if la.silhouette is not None else -2.0, la.site) for la in self.layers]
        return max(scored)[1]

    def layer(self, site: str) -> LayerAnalysis:
        for la in self.layers:
            if la.site == site:
                return la
        raise BadInputError(f"no analysis for {site}; analysed: {[la.site for la in self.layers]}")

    def to_dict(self) -> dict[str, Any]:
        return {"label_counts": self.label_counts, "best_site": self.best_site,
                "silhouette_per_layer": {la.site: la.silhouette for la in self.layers},
                "layers": [la.to_dict() for la in self.layers]}


def analyse(harvest: Harvest, saes: dict[str, Any], method: str = "umap", top_n: int = 8, min_votes: int = 1,
            seed: int = 0) -> RiseAnalysis:
    """Column association, geometry and behaviour vectors for every layer that has an SAE."""
    from saes.io import check_fits
    from saes.stats import encode_all, sae_stats

    labels = harvest.labels
    layers = []
    for site, sae in saes.items():
        acts = harvest.acts[site]
        check_fits(sae, acts.shape[1], site)
        latents = encode_all(sae, acts)
        assoc = associate_columns(latents, labels, top_n=top_n, min_votes=min_votes)
        coords, sil, sil_map = decoder_geometry(sae.W_dec, assoc.column_labels, method=method, seed=seed)
        top = latents.topk(min(3, latents.shape[1]), dim=1).indices.numpy()
        layers.append(LayerAnalysis(site, sae_stats(sae, acts), assoc, coords, sil, sil_map,
                                    behaviour_vectors(sae.W_dec, assoc.column_sets), top))
    return RiseAnalysis(layers, harvest.label_counts())


# --------------------------------------------------------------------------- steering


def steering_intervention(site: str, vector: torch.Tensor, alpha: float, mode: str = "projection") -> Any:
    """ProjectionRescale (h - alpha w (w.h)) or AddVector (h + alpha w) at every generated token."""
    from probes.interventions import AddVector, ProjectionRescale

    if mode == "projection":
        return ProjectionRescale(site, vector, alpha=alpha, where="generated")
    if mode == "add":
        return AddVector(site, vector, scale=alpha, where="generated")
    raise BadInputError(f"steering mode {mode!r}; use projection or add")


@dataclass
class SteeringRow:
    alpha: float
    n: int
    mean_reflection_steps: float
    mean_backtracking_steps: float
    mean_steps: float
    mean_tokens: float
    accuracy: float
    examples: list[str] = field(default_factory=list)
    generation_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SteeringResult:
    behaviour: str
    site: str
    mode: str
    rows: list[SteeringRow]
    problem_ids: list[str]
    traces: dict[float, list[TraceRecord]] = field(default_factory=dict, repr=False)  # vanilla vs steered

    def to_dict(self) -> dict[str, Any]:
        return {"behaviour": self.behaviour, "site": self.site, "mode": self.mode,
                "rows": [r.to_dict() for r in self.rows], "problem_ids": self.problem_ids}


def steer(engine: Any, problems: Sequence[Problem], vector: torch.Tensor, site: str,
          alphas: Sequence[float] = (-1.5, -1.0, 0.0, 1.0, 1.5), mode: str = "projection",
          settings: HarvestSettings | None = None, behaviour: str = "reflection", progress: bool = True) -> SteeringResult:
    """Generate on `problems` at each alpha (0 = vanilla) and count behaviours, length, accuracy."""
    from tqdm.auto import tqdm

    settings = settings or HarvestSettings()
    if not problems:
        raise BadInputError("no held-out problems to steer on; ask for n >= 1")
    delimiter = resolve_delimiter(settings.delimiter, engine.info()["model_id"])
    rows, by_alpha = [], {}
    for alpha in tqdm(list(alphas), desc="RISE steer", unit="alpha", disable=not progress):
        ivs = [] if float(alpha) == 0.0 else [steering_intervention(site, vector, float(alpha), mode)]
        traces: list[TraceRecord] = []
        started = time.perf_counter()
        for lo in range(0, len(problems), settings.batch_size):
            traces += generate_traces(engine, problems[lo:lo + settings.batch_size], settings, delimiter, ivs)
        by_alpha[float(alpha)] = traces
        counts = [count_behaviours(t.text, delimiter) for t in traces]
        rows.append(SteeringRow(
            alpha=float(alpha), n=len(traces),
            mean_reflection_steps=float(np.mean([c["reflection"] for c in counts])),
            mean_backtracking_steps=float(np.mean([c["backtracking"] for c in counts])),
            mean_steps=float(np.mean([len(t.steps) for t in traces])),
            mean_tokens=float(np.mean([t.n_tokens for t in traces])),
            accuracy=float(np.mean([t.correct for t in traces])),
            examples=[t.text for t in traces[:2]],
            generation_seconds=time.perf_counter() - started,
        ))
    return SteeringResult(behaviour, site, mode, rows, [p.id for p in problems], by_alpha)


# --------------------------------------------------------------------------- confidence vectors


@dataclass
class ConfidenceResult:
    """Coefficients over decoder columns that lower next-token entropy; top columns by |S|."""

    site: str
    coefficients: torch.Tensor  # [d_sae]
    top_columns: list[int]
    entropy_history: list[float]
    settings: dict[str, Any]

    def vector(self, w_dec: torch.Tensor, n: int = 3) -> torch.Tensor:
        """The enhancement direction: sum of up to `n` top columns weighted by their coefficients."""
        cols = self.top_columns[:n]
        return (self.coefficients[cols, None] * torch.as_tensor(w_dec).detach().float()[cols]).sum(0)

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "top_columns": self.top_columns,
                "top_coefficients": [float(self.coefficients[c]) for c in self.top_columns],
                "entropy_start": self.entropy_history[0] if self.entropy_history else None,
                "entropy_end": self.entropy_history[-1] if self.entropy_history else None,
                "entropy_history": self.entropy_history, "settings": self.settings}


def confidence_vectors(engine: Any, harvest: Harvest, sae: Any, site: str, iterations: int = 30, lr: float = 0.01,
                       batch_size: int = 8, top: int = 10, seed: int = 0, progress: bool = True) -> ConfidenceResult:
    """Minimise the mean next-token entropy over the generated tokens of harvested traces when
    `S @ W_dec` is added at `site` at the positions predicting them; the model stays frozen,
    only S [d_sae] learns.

    The engine's passes run without gradients, so this loop calls the model itself with one
    hook; the paper's 1000 iterations at batch 256 are a GPU budget, the CPU default is 30 x 8.
    """
    from tqdm.auto import tqdm

    from probes.sites import get_module, parse_site

    if not harvest.traces:
        raise BadInputError("no traces to fit confidence vectors on")
    handle, dev = engine.handle, engine.handle.device
    w_dec = sae.W_dec.detach().float().to(dev)
    coeffs = torch.zeros(w_dec.shape[0], device=dev, requires_grad=True)
    opt = torch.optim.Adam([coeffs], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, iterations))
    module = get_module(handle.model, parse_site(site).module_path(handle.family))
    rng = random.Random(seed)
    state: dict[str, torch.Tensor] = {}

    def add_at_generated(_m: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + state["gen_mask"].unsqueeze(-1) * (coeffs @ w_dec).to(hidden.dtype)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    history = []
    hook = module.register_forward_hook(add_at_generated)
    try:
        with torch.enable_grad():
            for _ in tqdm(range(iterations), desc="RISE confidence", disable=not progress):
                batch = [harvest.traces[rng.randrange(len(harvest.traces))] for _ in range(batch_size)]
                input_ids, mask, gen_mask = _padded(engine, batch)
                # Positions whose output predicts a generated token: where a `where="generated"`
                # intervention acts during generation, and where the entropy is measured.
                predict = torch.zeros_like(gen_mask)
                predict[:, :-1] = gen_mask[:, 1:]
                state["gen_mask"] = predict.float()
                hidden = handle.model.get_decoder()(input_ids=input_ids, attention_mask=mask).last_hidden_state
                logits = handle.model.get_output_embeddings()(hidden[predict.bool()]).float()
                logp = torch.log_softmax(logits, -1)
                entropy = -(logp.exp() * logp).sum(-1).mean()
                opt.zero_grad()
                entropy.backward()
                opt.step()
                sched.step()
                history.append(entropy.item())
    finally:
        hook.remove()
    final = coeffs.detach().cpu()
    order = final.abs().argsort(descending=True)[:top].tolist()
    settings = {"iterations": iterations, "lr": lr, "batch_size": batch_size, "seed": seed, "schedule": "cosine"}
    return ConfidenceResult(site, final, order, history, settings)


def _padded(engine: Any, traces: Sequence[TraceRecord]):
    dev = engine.handle.device
    seqs = [t.prompt_ids + t.gen_ids for t in traces]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), engine.tok.pad_token_id or 0, dtype=torch.long, device=dev)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
    gen = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
    for b, (t, seq) in enumerate(zip(traces, seqs)):
        ids[b, :len(seq)] = torch.tensor(seq, device=dev)
        mask[b, :len(seq)] = 1
        gen[b, len(t.prompt_ids):len(seq)] = 1
    return ids, mask, gen


# --------------------------------------------------------------------------- feature dashboard


@dataclass
class FeatureDashboard:
    """What one latent does: where it fires, how strongly, what it writes, which labels it sees."""

    site: str
    latent: int
    density: float
    max_activation: float
    top_steps: list[dict[str, Any]]
    histogram_counts: list[int]
    histogram_edges: list[float]
    promoted_tokens: list[tuple[str, float]]
    suppressed_tokens: list[tuple[str, float]]
    label_frequency: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feature_dashboard(harvest: Harvest, sae: Any, site: str, latent: int, unembed: torch.Tensor | None = None,
                      decode: Callable[[int], str] | None = None, k: int = 8, bins: int = 20,
                      latents: torch.Tensor | None = None) -> FeatureDashboard:
    """Dashboard data for `latent` of the SAE at `site`. `unembed` [vocab, d] (e.g. the model's
    output embedding) and `decode` (token id -> text) give the promoted/suppressed tokens."""
    from saes.stats import encode_all

    if not 0 <= latent < sae.cfg.d_sae:
        raise BadInputError(f"latent {latent} out of range; this SAE has latents 0..{sae.cfg.d_sae - 1}")
    z = (latents if latents is not None else encode_all(sae, harvest.acts[site]))[:, latent]
    active = z > 0
    order = z.argsort(descending=True)[:k].tolist()
    top_steps = []
    for row in order:
        if z[row] <= 0:
            break
        t, s = harvest.step_rows[row]
        step = harvest.traces[t].steps[s]
        top_steps.append({"row": row, "trace": t, "step": s, "activation": float(z[row]), "text": step.text,
                          "label": step.label, "problem_id": harvest.traces[t].problem.id})
    values = z[active].numpy()
    counts, edges = np.histogram(values, bins=bins) if values.size else (np.zeros(bins, int), np.linspace(0, 1, bins + 1))
    promoted, suppressed = [], []
    if unembed is not None:
        logits = torch.as_tensor(unembed).detach().float().cpu() @ sae.W_dec[latent].detach().float().cpu()
        name = decode or str
        promoted = [(name(i), float(logits[i])) for i in logits.topk(10).indices.tolist()]
        suppressed = [(name(i), float(logits[i])) for i in (-logits).topk(10).indices.tolist()]
    labels = [harvest.step(r).label for r in torch.nonzero(active).flatten().tolist()]
    freq = Counter(labels)
    return FeatureDashboard(site, latent, float(active.float().mean()), float(z.max()) if z.numel() else 0.0,
                            top_steps, counts.tolist(), [float(e) for e in edges], promoted, suppressed,
                            {label: freq.get(label, 0) for label in LABELS})


def engine_unembedding(engine: Any) -> tuple[torch.Tensor, Callable[[int], str]]:
    """The in-process engine's unembedding matrix [vocab, d] and a token decoder, for dashboards."""
    weight = engine.handle.model.get_output_embeddings().weight.detach()
    return weight, lambda i: engine.tok.decode([i])


# ----- the whole pipeline in one call (the page's Harvest + train button)


def run_pipeline(engine: Any, problems: list[Problem], settings: HarvestSettings, *, sae_steps: int, projection: str,
                 seed: int, model_id: str, on_progress=None) -> dict[str, Any]:
    """Harvest (resumable, in the ActivationStore), one SAE per layer, then the analysis.

    `on_progress(stage, done, total)` is called per harvest batch and per trained SAE (a page's bar).
    """
    from cache.store import ActivationStore
    from saes.train import SAETrainSettings, train_sae

    done: list = []
    store = ActivationStore()
    for lo in range(0, len(problems), settings.batch_size):  # one harvest per batch so the bar moves
        done.append(harvest(engine, problems[:lo + settings.batch_size], settings, store=store, progress=False))
        if on_progress:
            on_progress("harvest", min(lo + settings.batch_size, len(problems)), len(problems))
    h = done[-1]
    saes, stats = {}, {}
    for i, (site, acts) in enumerate(h.acts.items()):
        if acts.shape[0] < 2:
            raise TooFewStepsError(site, acts.shape[0])
        train = SAETrainSettings.scaled(acts.shape[1], acts.shape[0], seed=seed, steps=sae_steps, progress=False)
        saes[site], stats[site] = train_sae(acts, train, metadata={"model_name": model_id, "hook_name": site})
        if on_progress:
            on_progress("train", i + 1, len(h.acts))
    return {"harvest": h, "saes": saes, "stats": stats, "analysis": analyse(h, saes, method=projection, seed=seed)}


class TooFewStepsError(BadInputError):
    def __init__(self, site: str, n: int):
        super().__init__(f"only {n} step vector(s) at {site}: an SAE needs at least 2. Harvest more problems, "
                         "more tokens, or tick 'splice templated reflection/backtracking steps'.")

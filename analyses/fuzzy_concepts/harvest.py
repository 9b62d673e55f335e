"""Representations of a target token: one hidden state per sample, harvested through the Backend into `cache/`.

METHODS.md section 2, step 1 (the representation matrix Z of CoX-LMM, Parekh et al., arXiv 2406.08074):
the residual stream after layer l (`resid_post.l`) at the position of a target word, one row per sample.
A multi-token word is read at its last token (a causal model has seen the whole word there).

Samples come from a *representation source*: anything with `kind`, `settings()`, `samples(backend, store,
on_progress)` (the samples, each with the token position to read and a description to show) and
`read(backend, samples, site)` (their rows [n, d]). `TextSource` is the one for language models:

- `generate`: the model's own continuations of varied prompts that ask for the word in varied settings
  (seeded sampling); the row is read at the word's first occurrence in the generated text
  (`where="generated"`; samples whose continuation never says it are dropped) or, failing that, at
  its last occurrence in the prompt (`where="any"`). Each sample is labelled with its setting.
- `gsm8k` / `arith`: questions of the GSM8K test set or of the arithmetic task generator (analyses.tasks)
  that contain the word (arith questions are labelled with their operation).
- `texts`: texts the user gives.

An image source (toy-vlm scenes, the answer token) plugs in beside it with the same three methods once
the engine reads images; nothing here assumes text beyond `TextSource`.

Rows are read with one batched teacher-forced pass per batch (`capture_batch(..., positions=...)`,
so a model server ships only the rows asked for) and stored per sample in the `ActivationStore`,
keyed by the model fingerprint, the sample's tokens and position, and the site; generations are stored
per batch. A rerun, another target word on the same texts, or another layer recomputes only what is
missing. Progress goes through `on_progress(stage, done, total)`.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from analyses.tasks import load_gsm8k, load_task
from probes.backend import Backend
from probes.engine import Sampling
from thoughtscope import checks
from thoughtscope.errors import BadInputError

Progress = Callable[[str, int, int], None]
SOURCES = ("generate", "gsm8k", "arith", "texts")
SOURCES_HELP = ("generate: the model's own continuations of prompts asking for the word in varied settings; "
                "gsm8k: GSM8K test questions holding the word; arith: generated arithmetic questions holding it "
                "(labelled with their operation); texts: your own texts")
WHERE = ("generated", "any")
REP_KIND = "fuzzy-rep/v1"
GEN_KIND = "fuzzy-gen/v1"

# Settings that the generated samples are asked to place the word in; each becomes the sample's label.
CONTEXTS = ("at the beach", "in a busy city", "on a farm", "in a children's story", "in a science lesson",
            "on a cold winter night", "in a kitchen", "in a news report", "in a poem", "at a hospital",
            "in a video game", "in a forest", "at school", "at a football match", "in a museum", "during a storm")
TEMPLATES = ('Write two sentences that use the word "{word}", set {context}.',
             'Use the word "{word}" in a very short story set {context}.',
             'Describe a scene {context} in two sentences. Use the word "{word}".')


def default_layer(n_layers: int) -> int:
    """Two thirds of the depth: CoX-LMM found deeper layers hold the more semantic concepts."""
    return max(0, min(n_layers - 1, round(2 * n_layers / 3)))


def check_layer(layer: int, n_layers: int) -> str:
    """The site of `layer`, or a project error naming the valid range."""
    if not checks.is_integer(layer) or not 0 <= layer < n_layers:
        raise BadInputError(f"layer {layer!r} is out of range: this model has layers 0..{n_layers - 1}")
    return f"resid_post.{layer}"


def check_word(word: Any) -> str:
    if not isinstance(word, str) or not word.strip():
        raise BadInputError("give a target word, e.g. water (the word whose hidden states are decomposed)")
    if "\n" in word or len(word.strip()) > 64:
        raise BadInputError(f"the target must be one word or a short phrase on one line, got {word!r}")
    return word.strip()


def word_pattern(word: str) -> re.Pattern[str]:
    """The word as a whole word, any case: 'dog' matches 'Dog' and 'dog.' but not 'dogs' or 'hotdog'."""
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", re.IGNORECASE)


# --------------------------------------------------------------------------- samples


@dataclass
class Sample:
    """One row of Z: its tokens, the position read, the text shown with the word's span, and labels."""

    id: str
    key: str  # identifies the row's input for the store (tokens and position for text)
    ids: list[int]
    position: int
    text: str
    span: tuple[int, int]  # character span of the target word in `text`
    prompt_chars: int = 0  # characters of `text` that were the prompt (generated text follows)
    labels: dict[str, str] = field(default_factory=dict)

    def snippet(self, width: int = 70) -> str:
        """The text around the word, the word in [brackets], one line."""
        a, b = self.span
        left = self.text[max(self.prompt_chars, a - width):a] if a >= self.prompt_chars else self.text[max(0, a - width):a]
        right = self.text[b:b + width]
        clean = lambda s: " ".join(s.split())  # noqa: E731
        return f"\u2026{clean(left)} [{self.text[a:b]}] {clean(right)}\u2026"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("ids")
        d["snippet"] = self.snippet()
        return d


class RepresentationSource(Protocol):
    """Where the samples of Z come from: text now, images plus prompts for a vision-language model later."""

    kind: str

    def settings(self) -> dict[str, Any]:
        """Everything the samples depend on (provenance and the generation cache key)."""

    def samples(self, backend: Backend, store: Any = None, on_progress: Progress | None = None) -> list[Sample]:
        """The samples, each with the position to read; a project error if the target occurs in none."""

    def read(self, backend: Backend, samples: Sequence[Sample], site: str) -> torch.Tensor:
        """The rows [len(samples), d] at `site`."""


@dataclass
class TextSource:
    """Text samples holding a target word (see the module docstring for the kinds)."""

    word: str
    kind: str = "generate"
    n: int = 200
    texts: tuple[str, ...] = ()
    where: str = "generated"
    max_new_tokens: int = 40
    temperature: float = 0.8
    top_p: float = 0.95
    batch_size: int = 16
    seed: int = 0

    def settings(self) -> dict[str, Any]:
        out = asdict(self)
        out["texts"] = len(self.texts)  # provenance names how many; the store keys the tokens themselves
        return out

    def validate(self) -> None:
        check_word(self.word)
        checks.choice("source", self.kind, SOURCES)
        checks.choice("where", self.where, WHERE)
        checks.integer("the number of samples", self.n, low=1)
        if self.kind == "texts" and not any(t.strip() for t in self.texts):
            raise BadInputError("the texts source needs at least one text (one per line)")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise BadInputError("batch_size and max_new_tokens must be positive")

    # ----- the samples -----

    def samples(self, backend: Backend, store: Any = None, on_progress: Progress | None = None) -> list[Sample]:
        self.validate()
        word = check_word(self.word)
        if self.kind == "generate":
            found = self._generated(backend, store, on_progress)
            searched = f"{self.n} generated continuations" + (" (generated part only)" if self.where == "generated" else "")
        else:
            texts, labels = self._corpus()
            found = []
            for i, (text, label) in enumerate(zip(texts, labels)):
                sample = locate(backend, backend.encode(text), word, f"{self.kind}-{i}", label)
                if sample is not None:
                    found.append(sample)
                if len(found) == self.n:
                    break
            searched = f"{len(texts)} {self.kind} texts"
        if not found:
            raise BadInputError(f"the word {word!r} never occurs in {searched}; pick a word these texts use "
                                + ("(or --where any, to fall back on the prompt's occurrence)" if self.kind == "generate" else ""))
        return found

    def _corpus(self) -> tuple[list[str], list[dict[str, str]]]:
        if self.kind == "texts":
            texts = [t.strip() for t in self.texts if t.strip()]
            return texts, [{} for _ in texts]
        pattern = word_pattern(check_word(self.word))
        if self.kind == "gsm8k":
            problems = load_gsm8k(seed=self.seed)
            labels = [{} for _ in problems]
        else:  # arith: many more than needed, the word may be rare among them
            problems = load_task("arith-mixed", max(4 * self.n, 200), seed=self.seed)
            labels = [{"operation": " ".join(p.meta.get("ops", []))} for p in problems]
        keep = [(p.question, lab) for p, lab in zip(problems, labels) if pattern.search(p.question)]
        random.Random(self.seed).shuffle(keep)  # harmless for gsm8k (already shuffled), varied for arith
        return [q for q, _ in keep], [lab for _, lab in keep]

    def prompts(self) -> list[tuple[list[dict[str, str]], dict[str, str]]]:
        """The chat prompts of the generated samples and their labels (setting and template), in order."""
        word = check_word(self.word)
        out = []
        for i in range(self.n):
            context = CONTEXTS[i % len(CONTEXTS)]
            template = TEMPLATES[(i // len(CONTEXTS)) % len(TEMPLATES)]
            out.append(([{"role": "user", "content": template.format(word=word, context=context)}],
                        {"context": context, "template": str(TEMPLATES.index(template))}))
        return out

    def _generated(self, backend: Backend, store: Any, on_progress: Progress | None) -> list[Sample]:
        info = backend.info()
        eos = set(backend.eos_ids())
        prompts = self.prompts()
        found: list[Sample] = []
        for lo in range(0, len(prompts), self.batch_size):
            batch = prompts[lo:lo + self.batch_size]
            messages = [m for m, _ in batch]
            seed = self.seed * 1_000_003 + lo
            key = json.dumps({"kind": GEN_KIND, "prompts": messages, "seed": seed}, sort_keys=True)
            settings = {"kind": GEN_KIND, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                        "top_p": self.top_p, "chat": True}
            entry = store.get(info["fingerprint"], key, settings, []) if store is not None else None
            if entry is not None:
                gen_ids = entry.meta["gen_ids"]
            else:
                gen_ids = [[] for _ in batch]
                for rec in backend.generate(prompts=messages, max_new_tokens=self.max_new_tokens, chat=True,
                                            sampling=Sampling(self.temperature, self.top_p), seed=seed):
                    if rec.token_id not in eos:
                        gen_ids[rec.batch_index].append(int(rec.token_id))
                if store is not None:
                    store.put(info["fingerprint"], key, settings, [], {}, {"gen_ids": gen_ids})
            for j, ((msgs, labels), gen) in enumerate(zip(batch, gen_ids)):
                prompt_ids = backend.encode(msgs, chat=True)
                sample = locate(backend, prompt_ids + list(gen), self.word, f"gen-{lo + j}", labels,
                                prompt_tokens=len(prompt_ids), where=self.where)
                if sample is not None:
                    found.append(sample)
            if on_progress:
                on_progress("generate", min(lo + self.batch_size, len(prompts)), len(prompts))
        return found

    # ----- the rows -----

    def read(self, backend: Backend, samples: Sequence[Sample], site: str) -> torch.Tensor:
        acts = backend.capture_batch([s.ids for s in samples], [site], positions=[[s.position] for s in samples])
        return acts[site].float().reshape(len(samples), -1)


def locate(backend: Backend, ids: list[int], word: str, sample_id: str, labels: dict[str, str] | None = None,
           prompt_tokens: int = 0, where: str = "any") -> Sample | None:
    """The sample of `ids` read at the target word, or None when the word is not there.

    Without a prompt (`prompt_tokens=0`) the first occurrence is taken. With one, the first occurrence in
    the generated part; failing that, with `where="any"`, the last occurrence in the prompt.
    """
    pieces = backend.token_texts(ids)
    text = "".join(pieces)
    ends, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    prompt_chars = ends[prompt_tokens - 1] if prompt_tokens > 0 else 0
    matches = list(word_pattern(word).finditer(text))
    generated = [m for m in matches if m.start() >= prompt_chars]
    if generated:
        match = generated[0]
    elif where == "any" and matches:
        match = matches[-1]
    else:
        return None
    # the token holding the word's last character
    position = next(i for i, end in enumerate(ends) if end >= match.end())
    key = json.dumps({"ids": list(map(int, ids)), "position": position})
    return Sample(sample_id, key, list(map(int, ids)), position, text, (match.start(), match.end()), prompt_chars,
                  dict(labels or {}))


# --------------------------------------------------------------------------- harvest


@dataclass
class Representations:
    """Z [n, d] at `site` with its samples (row i is `samples[i]`)."""

    model_id: str
    fingerprint: str
    site: str
    word: str
    source: dict[str, Any]
    samples: list[Sample]
    Z: torch.Tensor
    n_from_cache: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def layer(self) -> int:
        return int(self.site.rsplit(".", 1)[1])

    def label_kinds(self) -> list[str]:
        """Label names every sample carries (e.g. `context`), usable for AMI."""
        kinds = set(self.samples[0].labels) if self.samples else set()
        for s in self.samples:
            kinds &= set(s.labels)
        return sorted(kinds)

    def labels(self, kind: str, rows: Sequence[int] | None = None) -> list[str]:
        rows = range(len(self.samples)) if rows is None else rows
        return [self.samples[i].labels[kind] for i in rows]

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        out = {"model_id": self.model_id, "fingerprint": self.fingerprint, "site": self.site, "word": self.word,
               "source": self.source, "n_samples": len(self.samples), "width": int(self.Z.shape[1]),
               "n_from_cache": self.n_from_cache, "seconds": self.seconds, "label_kinds": self.label_kinds()}
        if with_samples:
            out["samples"] = [s.to_dict() for s in self.samples]
        return out


def harvest(backend: Backend, source: Any, layer: int, store: Any = None, batch_size: int = 16,
            on_progress: Progress | None = None) -> Representations:
    """Z at `resid_post.<layer>` for every sample of `source`; rows reused from and added to `store`.

    Checks the layer before any model work and the rows for NaN before returning them.
    """
    info = backend.info()
    site = check_layer(layer, backend.arch().n_layers)
    started = time.perf_counter()
    samples = source.samples(backend, store, on_progress)
    sample_s = time.perf_counter() - started
    rows: list[torch.Tensor | None] = [None] * len(samples)
    settings = {"kind": REP_KIND}
    if store is not None:
        for i, s in enumerate(samples):
            entry = store.get(info["fingerprint"], s.key, settings, [site])
            rows[i] = entry.tensors[site] if entry is not None else None
    from_cache = sum(r is not None for r in rows)
    todo = [i for i, r in enumerate(rows) if r is None]
    started = time.perf_counter()
    for lo in range(0, len(todo), batch_size):
        chunk = todo[lo:lo + batch_size]
        read = source.read(backend, [samples[i] for i in chunk], site)
        for i, row in zip(chunk, read):
            rows[i] = row.clone()
            if store is not None and torch.isfinite(row).all():
                store.put(info["fingerprint"], samples[i].key, settings, [site], {site: rows[i]},
                          {"sample": samples[i].id})
        if on_progress:
            on_progress("read", from_cache + lo + len(chunk), len(samples))
    Z = torch.stack(rows).float()
    bad = (~torch.isfinite(Z)).any(1)
    if bad.any():
        raise BadInputError(f"{int(bad.sum())} of {len(samples)} representations at {site} hold NaN or infinite "
                            f"values (e.g. sample {samples[int(bad.nonzero()[0])].id}); the model overflows at "
                            "this layer or dtype: try another layer or load the model in float32")
    return Representations(info["model_id"], info["fingerprint"], site, check_word(source.word), source.settings(),
                           samples, Z, from_cache, {"samples": sample_s, "read": time.perf_counter() - started})

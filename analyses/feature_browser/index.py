"""The activations of a corpus at one site, computed once into the cache and read back for every browse.

Each context (a corpus text, cut into windows of at most `max_tokens` tokens) is run through the
model once, in batches, through `Backend.capture_batch` with `positions`, so a model server ships
only the rows asked for. The first token of every context is left out: it is the attention sink,
whose residual norm is many times the others' and would top every direction (Neuronpedia and
SAEDashboard leave out the BOS for the same reason). Rows are stored as float16 (float32 where a
value does not fit) in `cache.store.ActivationStore`, one entry per chunk of contexts, keyed by
the model fingerprint, the corpus digest, the site and the settings: an interrupted build
resumes, and a finished one loads in seconds.

Example:
    >>> from probes import Engine
    >>> from analyses.feature_browser import load_corpus
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> index = build_index(engine, load_corpus("gsm8k-questions", n=4), "resid_post.1", store=None)
    >>> index.n_contexts, index.acts.shape[1]   # 4 questions; the first, 66 tokens, is cut into two windows
    (5, 64)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from analyses.feature_browser.corpus import Corpus
from cache.store import ActivationStore
from probes.backend import Backend
from probes.sites import GLOBAL_SITES, SITE_KINDS, parse_site
from thoughtscope.errors import BadInputError

INDEX_VERSION = 1
FLOAT16_MAX = 65_000.0
DTYPES = {"float16": torch.float16, "float32": torch.float32}

Progress = Callable[[int, int], None]  # (contexts done, contexts in all)
# one d_model vector per token: the residual stream and what the attention and MLP blocks write into it, where a
# direction's write vector reads through the unembedding (per-head, pattern, router and logit sites do not)
BROWSABLE_KINDS = tuple(kind for kind, spec in SITE_KINDS.items() if spec.shape == "[d_model]")


def check_site(site: str) -> str:
    """`site` when the feature browser can read it (see `BROWSABLE_KINDS`), else a clear error naming the sites
    it can; the layer is checked against the model later (`probes.sites.site_width`)."""
    parsed = parse_site(site)
    if parsed.kind not in BROWSABLE_KINDS:
        spec = GLOBAL_SITES.get(parsed.kind) or SITE_KINDS[parsed.kind]
        usable = ", ".join(f"{kind}.<layer>" for kind in BROWSABLE_KINDS)
        raise BadInputError(f"site {site!r} holds {spec.shape} per token ({spec.doc}), not one residual-stream "
                            f"vector; the feature browser reads {usable}")
    return site


@dataclass
class IndexSettings:
    """How a corpus is indexed: at most `max_tokens` per context, `batch_size` contexts per forward,
    rows stored as `dtype`, `chunk_size` contexts per cache entry."""

    max_tokens: int = 64
    batch_size: int = 32
    dtype: str = "float16"
    chunk_size: int = 512

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise BadInputError(f"dtype={self.dtype!r}; store activations as one of {', '.join(DTYPES)}")
        for name in ("max_tokens", "batch_size", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (2 if name == "max_tokens" else 1):
                raise BadInputError(f"{name} must be a positive integer (max_tokens at least 2), got {value!r}")

    def key(self) -> dict[str, Any]:
        """What changes the stored rows (the batch size does not)."""
        return {"max_tokens": self.max_tokens, "dtype": self.dtype, "chunk_size": self.chunk_size}


@dataclass
class CorpusIndex:
    """Token ids of every context and the activation rows of its positions 1.. at `site`.

    `ids` [T] holds every context's tokens back to back (`lengths` [C] of them each); `acts` [N, d]
    holds the rows of positions 1..length-1 of each context, in order (N = T - C).
    """

    corpus: dict[str, Any]
    site: str
    model_id: str
    fingerprint: str
    settings: IndexSettings
    ids: torch.Tensor
    lengths: torch.Tensor
    acts: torch.Tensor
    id_offsets: torch.Tensor = field(init=False, repr=False)
    row_offsets: torch.Tensor = field(init=False, repr=False)
    row_context: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lengths = self.lengths.long()
        zero = torch.zeros(1, dtype=torch.long)
        self.id_offsets = torch.cat([zero, lengths.cumsum(0)])
        self.row_offsets = torch.cat([zero, (lengths - 1).cumsum(0)])
        self.row_context = torch.repeat_interleave(torch.arange(len(lengths)), lengths - 1)
        if self.row_offsets[-1] != self.acts.shape[0]:
            raise BadInputError("the stored activations do not match the stored tokens; clear the cache entry")

    @property
    def n_contexts(self) -> int:
        return int(self.lengths.numel())

    @property
    def n_rows(self) -> int:
        return int(self.acts.shape[0])

    def context_ids(self, c: int) -> list[int]:
        return self.ids[self.id_offsets[c]:self.id_offsets[c + 1]].tolist()

    def rows(self, c: int) -> slice:
        return slice(int(self.row_offsets[c]), int(self.row_offsets[c + 1]))

    @property
    def nbytes(self) -> int:
        return self.acts.numel() * self.acts.element_size()

    def describe(self) -> dict[str, Any]:
        return {"corpus": self.corpus, "site": self.site, "model": self.model_id, "fingerprint": self.fingerprint,
                "settings": asdict(self.settings), "n_contexts": self.n_contexts, "n_tokens": self.n_rows,
                "first_token_excluded": True}


def tokenize_corpus(backend: Backend, corpus: Corpus, max_tokens: int) -> list[list[int]]:
    """Every text as token ids, cut into windows of at most `max_tokens`; windows of one token dropped."""
    contexts = []
    for number, text in enumerate(corpus.texts, 1):
        try:
            ids = backend.encode(text)
        except BadInputError as err:  # a paragraph past the model's context: say which, and how to cut it
            raise BadInputError(f"text {number} of {corpus.name!r} ({len(text):,} characters): {err}. Each text is "
                                f"read whole before it is cut into windows of {max_tokens} tokens: split it with "
                                "blank lines (one context per paragraph) or take one context per line") from err
        contexts += [ids[i:i + max_tokens] for i in range(0, len(ids), max_tokens) if len(ids[i:i + max_tokens]) > 1]
    if not contexts:
        raise BadInputError(f"the corpus {corpus.name!r} has no text of two tokens or more")
    return contexts


def _chunk_rows(backend: Backend, chunk: Sequence[list[int]], site: str, settings: IndexSettings,
                on_batch: Callable[[int], None]) -> torch.Tensor:
    """Rows of positions 1.. of every context of the chunk, in chunk order (forwards in length order,
    so a batch pads little)."""
    order = sorted(range(len(chunk)), key=lambda k: len(chunk[k]))
    parts: dict[int, torch.Tensor] = {}
    for lo in range(0, len(order), settings.batch_size):
        idx = order[lo:lo + settings.batch_size]
        seqs = [list(chunk[k]) for k in idx]
        out = backend.capture_batch(seqs, [site], positions=[list(range(1, len(s))) for s in seqs])[site]
        for k, rows in zip(idx, torch.split(out.float().cpu(), [len(s) - 1 for s in seqs])):
            parts[k] = rows
        on_batch(len(idx))
    acts = torch.cat([parts[k] for k in range(len(chunk))])
    dtype = DTYPES[settings.dtype]
    if dtype == torch.float16 and acts.abs().max() > FLOAT16_MAX:
        return acts  # would overflow float16: this chunk stays float32
    return acts.to(dtype)


def build_index(backend: Backend, corpus: Corpus, site: str, settings: IndexSettings | None = None, store: Any = "default",
                on_progress: Progress | None = None) -> CorpusIndex:
    """The corpus' activations at `site`: loaded from `store` (an ActivationStore; "default" for the user
    cache, None for no cache) where they are, computed (and stored) where not."""
    settings = settings or IndexSettings()
    settings.validate()
    check_site(site)
    info = backend.info()
    if site not in {row["site"] for row in backend.sites()}:
        raise BadInputError(f"{info.get('model_id')} has no site {site!r}; pick e.g. resid_post.<layer>")
    if store == "default":
        store = ActivationStore()
    contexts = tokenize_corpus(backend, corpus, settings.max_tokens)
    chunks = [contexts[i:i + settings.chunk_size] for i in range(0, len(contexts), settings.chunk_size)]
    total, done = len(contexts), 0
    if on_progress:
        on_progress(0, total)
    acts, ids, lengths = [], [], []
    for i, chunk in enumerate(chunks):
        flat = [t for ctx in chunk for t in ctx]
        key = dict(kind="feature_browser.index", version=INDEX_VERSION, n=len(chunk), **settings.key(),
                   ids=hashlib.sha256(torch.tensor(flat, dtype=torch.int64).numpy().tobytes()).hexdigest()[:24])
        prompt = f"feature-browser/{corpus.key}/{i}"
        entry = store.get(info["fingerprint"], prompt, key, [site]) if store is not None else None
        if entry is None:
            def on_batch(n: int) -> None:
                nonlocal done
                done += n
                if on_progress:
                    on_progress(done, total)

            rows = _chunk_rows(backend, chunk, site, settings, on_batch)
            if store is not None:
                store.put(info["fingerprint"], prompt, key, [site], {"acts": rows},
                          meta={"corpus": corpus.name, "chunk": i, "model": info.get("model_id")})
        else:
            rows = entry.tensors["acts"]
            done += len(chunk)
            if on_progress:
                on_progress(done, total)
        acts.append(rows)
        ids.append(torch.tensor(flat, dtype=torch.int32))
        lengths.append(torch.tensor([len(c) for c in chunk], dtype=torch.int32))
    dtype = torch.float32 if any(a.dtype == torch.float32 for a in acts) else DTYPES[settings.dtype]
    return CorpusIndex(corpus.describe(), site, info.get("model_id", "?"), info["fingerprint"], settings,
                       torch.cat(ids), torch.cat(lengths), torch.cat([a.to(dtype) for a in acts]))

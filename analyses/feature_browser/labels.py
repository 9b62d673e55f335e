"""A label for every latent of an SAE, from a stored corpus index and the decoder: no language model needed.

Neuronpedia labels latents with an explainer model; this is the model-free part of its dashboard
[recon]: for each latent, the tokens it fires on most often, its top contexts (with the most
active token marked), and the words its decoder row writes (read through the unembedding without
the final norm, `Backend.readout(norm=False)`, as the feature browser's logit panel does). A
latent that never fires on the corpus is labelled dead, one that fires on fewer than
`LabelSettings.min_active` tokens weak: its label says so, and search shows the flag.

Labels are kept beside the SAE (`labels.thoughtscope.json` in its SAELens folder) under a key of the
SAE's weights (sha256), the corpus index (model fingerprint, corpus, site, settings) and the
label settings: when the SAE or the index changes, `labels_for` rebuilds them.

Example:
    >>> from probes import Engine
    >>> from analyses.feature_browser import build_index, load_corpus
    >>> from saes.train import SAETrainSettings, make_training_sae
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> index = build_index(engine, load_corpus("gsm8k-questions", n=4), "resid_post.1", store=None)
    >>> sae = make_training_sae(64, SAETrainSettings(d_sae=8))
    >>> labels = build_labels(index, sae, engine)
    >>> len(labels.labels), labels.labels[0].latent
    (8, 0)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from analyses.feature_browser.index import CorpusIndex
from analyses.feature_browser.token_latents import check_sae
from probes.backend import Backend
from saes.io import check_fits
from thoughtscope.errors import BadInputError

LABELS_FILE = "labels.thoughtscope.json"
LABELS_VERSION = 1
BLOCK_ROWS = 2_048  # corpus rows encoded at a time: [BLOCK_ROWS, d_sae] floats stay small for a 16k-latent SAE
READOUT_BLOCK = 512  # decoder rows read out at a time (a server request stays a few MB)

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class LabelSettings:
    """How many tokens, contexts and output words a label keeps; `window` tokens each side of a
    context's most active token; under `min_active` activating tokens a label is weak."""

    n_tokens: int = 8
    n_contexts: int = 4
    n_words: int = 8
    window: int = 6
    min_active: int = 5

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < (0 if name == "min_active" else 1):
                raise BadInputError(f"label setting {name} must be a positive integer, got {value!r}")


@dataclass
class LatentLabel:
    """What one latent fires on and writes."""

    latent: int
    n_active: int  # corpus tokens where it is > 0
    max_activation: float
    top_tokens: list[list[Any]]  # [token text, count] by count, most frequent first
    contexts: list[str]  # the top contexts' windows, the most active token in «»
    output_words: list[str]  # the tokens its decoder row promotes most
    quality: str  # "ok", "weak" or "dead"

    @property
    def summary(self) -> str:
        """One line: what the latent fires on and what it writes."""
        if self.quality == "dead":
            return "dead: never fires on the indexed corpus"
        tokens = ", ".join(repr(t) for t, _ in self.top_tokens[:4])
        words = ", ".join(repr(w) for w in self.output_words[:4])
        flag = f"weak ({self.n_active} activations): " if self.quality == "weak" else ""
        return f"{flag}fires on {tokens}; writes {words}"

    def document(self) -> str:
        """The text search ranks: top tokens (weighted by how often they fire), output words, contexts."""
        tokens = " ".join(" ".join([str(t)] * min(int(n), 8)) for t, n in self.top_tokens)
        return "\n".join([tokens, " ".join(self.output_words), *self.contexts])


@dataclass
class LatentLabels:
    """Labels of every latent of one SAE over one corpus index."""

    key: dict[str, Any]
    labels: list[LatentLabel]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "labels": [asdict(lab) for lab in self.labels]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LatentLabels":
        return cls(data["key"], [LatentLabel(**lab) for lab in data["labels"]])

    def counts(self) -> dict[str, int]:
        out = {"ok": 0, "weak": 0, "dead": 0}
        for lab in self.labels:
            out[lab.quality] += 1
        return out


def sae_sha(sae: Any) -> str:
    """sha256 of the SAE's weights (encoder, decoder, biases): the labels' key changes with any of them."""
    h = hashlib.sha256()
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        h.update(getattr(sae, name).detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def labels_key(index: CorpusIndex, sae: Any, settings: LabelSettings) -> dict[str, Any]:
    return {"version": LABELS_VERSION, "sae_sha256": sae_sha(sae), "fingerprint": index.fingerprint,
            "corpus": index.corpus.get("key", index.corpus.get("name")), "site": index.site,
            "index_settings": asdict(index.settings), "n_rows": index.n_rows, "settings": asdict(settings)}


def row_tokens(index: CorpusIndex) -> torch.Tensor:
    """The token id at every stored row [N] (row r is position >= 1 of its context)."""
    n = torch.arange(index.n_rows)
    ctx = index.row_context
    return index.ids.long()[index.id_offsets[ctx] + (n - index.row_offsets[ctx]) + 1]


@torch.no_grad()
def _encode(sae: Any, acts: torch.Tensor) -> torch.Tensor:
    z = sae.encode(acts.to(sae.W_enc.dtype))
    return (z.to_dense() if z.is_sparse else z).float()


@torch.no_grad()
def _scan(index: CorpusIndex, sae: Any, keep: int, on_progress: Progress | None):
    """One pass over the rows: per latent its activation count, max, best rows and (latent, token) counts."""
    d_sae = int(sae.cfg.d_sae)
    tokens = row_tokens(index)
    vocab = int(tokens.max()) + 1 if tokens.numel() else 1
    n_active = torch.zeros(d_sae, dtype=torch.long)
    best_vals = torch.full((d_sae, keep), -torch.inf)
    best_rows = torch.full((d_sae, keep), -1, dtype=torch.long)
    pair_keys: list[torch.Tensor] = []
    for lo in range(0, index.n_rows, BLOCK_ROWS):
        z = _encode(sae, index.acts[lo:lo + BLOCK_ROWS].float())
        active = z > 0
        n_active += active.sum(0)
        rows, latents = active.nonzero(as_tuple=True)
        pair_keys.append(latents * vocab + tokens[lo + rows])
        m = min(keep, z.shape[0])
        vals, at = z.topk(m, dim=0)  # [m, d_sae]
        merged_vals = torch.cat([best_vals, vals.T], 1)
        merged_rows = torch.cat([best_rows, (at + lo).T], 1)
        top = merged_vals.topk(keep, dim=1)
        best_vals, best_rows = top.values, merged_rows.gather(1, top.indices)
        if on_progress:
            on_progress("encode", min(lo + BLOCK_ROWS, index.n_rows), index.n_rows)
    pairs, counts = torch.unique(torch.cat(pair_keys) if pair_keys else torch.zeros(0, dtype=torch.long),
                                 return_counts=True)
    return n_active, best_vals, best_rows, pairs // vocab, pairs % vocab, counts


def _window(index: CorpusIndex, texts: dict[int, str], row: int, window: int) -> str:
    c = int(index.row_context[row])
    pos = row - int(index.row_offsets[c]) + 1  # the row's token position in its context
    lo, hi = max(0, pos - window), min(int(index.lengths[c]), pos + window + 1)
    start = int(index.id_offsets[c])
    ids = index.ids[start + lo:start + hi].tolist()
    parts = [f"\u00ab{texts[i]}\u00bb" if lo + k == pos else texts[i] for k, i in enumerate(ids)]
    return "".join(parts)


def _output_words(sae: Any, backend: Backend, n_words: int, on_progress: Progress | None) -> list[list[str]]:
    w_dec = sae.W_dec.detach().float().cpu()
    out: list[list[str]] = []
    for lo in range(0, w_dec.shape[0], READOUT_BLOCK):
        read = backend.readout(w_dec[lo:lo + READOUT_BLOCK], norm=False, top_k=n_words, bottom_k=0)
        for ids in read.top_ids.tolist():
            out.append(backend.token_texts(ids))
        if on_progress:
            on_progress("decoder words", min(lo + READOUT_BLOCK, w_dec.shape[0]), w_dec.shape[0])
    return out


def build_labels(index: CorpusIndex, sae: Any, backend: Backend, settings: LabelSettings | None = None,
                 on_progress: Progress | None = None) -> LatentLabels:
    """Labels of every latent of `sae` over `index` (read at the SAE's site), decoder words via `backend`."""
    settings = settings or LabelSettings()
    settings.validate()
    check_fits(sae, int(index.acts.shape[1]), index.site)
    check_sae(sae, backend, index.site)  # an SAE whose config names another model or site is refused
    keep = settings.n_contexts * 4  # best rows kept per latent: several may share a context
    n_active, best_vals, best_rows, pair_latent, pair_token, pair_count = _scan(index, sae, keep, on_progress)
    unique = torch.unique(index.ids.long()).tolist()  # each token decoded once, not once per occurrence
    vocab_text = dict(zip(unique, backend.token_texts(unique)))
    order = torch.argsort(pair_latent * (int(pair_count.max()) + 1 if pair_count.numel() else 1) - pair_count,
                          stable=True)  # by latent, then most frequent first
    pair_latent, pair_token, pair_count = pair_latent[order], pair_token[order], pair_count[order]
    starts = torch.searchsorted(pair_latent, torch.arange(int(sae.cfg.d_sae) + 1))
    words = _output_words(sae, backend, settings.n_words, on_progress)
    labels = []
    for j in range(int(sae.cfg.d_sae)):
        lo, hi = int(starts[j]), min(int(starts[j + 1]), int(starts[j]) + settings.n_tokens)
        top_tokens = []
        for t, n in zip(pair_token[lo:hi].tolist(), pair_count[lo:hi].tolist()):
            top_tokens.append([vocab_text[t], int(n)])
        contexts, seen = [], set()
        for v, r in zip(best_vals[j].tolist(), best_rows[j].tolist()):
            c = int(index.row_context[r]) if r >= 0 else -1
            if v <= 0 or c in seen:
                continue
            seen.add(c)
            contexts.append(_window(index, vocab_text, r, settings.window))
            if len(contexts) == settings.n_contexts:
                break
        n = int(n_active[j])
        quality = "dead" if n == 0 else "weak" if n < settings.min_active else "ok"
        labels.append(LatentLabel(j, n, max(0.0, float(best_vals[j, 0])), top_tokens, contexts, words[j], quality))
    return LatentLabels(labels_key(index, sae, settings), labels)


def labels_path(folder: str | Path) -> Path:
    return Path(folder) / LABELS_FILE


def labels_for(folder: str | Path, sae: Any, index: CorpusIndex, backend: Backend,
               settings: LabelSettings | None = None, on_progress: Progress | None = None) -> LatentLabels:
    """The labels kept beside the SAE in `folder` when they are of this SAE, index and settings; else
    built and written there (a folder that cannot be written keeps nothing: they are rebuilt next time)."""
    settings = settings or LabelSettings()
    path = labels_path(folder)
    key = labels_key(index, sae, settings)
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return LatentLabels.from_dict(stored)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or damaged, or of another SAE: rebuilt below
    labels = build_labels(index, sae, backend, settings, on_progress)
    try:
        path.write_text(json.dumps(labels.to_dict()))
    except OSError:
        pass
    return labels



"""Where steering acts, and the record of what it did: the chat-template preset and the per-call run.

`template_pieces(tokenizer)` derives a model family's chat-template tokens from the template itself,
not from a hand list: it renders the template around marker messages, tokenizes the result with
offsets, and keeps every run of tokens outside the markers that starts with a special token
(`<|im_start|>user\\n`, `<|im_end|>\\n`, the default system prompt a template inserts). A prompt's
excluded positions (`excluded_positions`) are its special tokens plus every occurrence of a piece.

`SteerRun` is one engine call's steering state (a `probes.calls` part the call's `SteerEdit`s share):
a forward pre-hook on the model reads which row positions and token ids the forward in flight covers,
so each term's mask [batch, seq] is known before its site runs; each term applies as
`where(mask, steer(x), x)` and reports the L2 norm it added at each position (`ctx.fire`), which the
engine reads into `TokenRecord.fired` and `Trace.fired`.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> ids = engine.encode([{"role": "user", "content": "hi there"}])
    >>> [engine.token_texts(ids)[p] for p in range(len(ids)) if p not in excluded_positions(engine.tok, ids)]
    ['hi', ' there']
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from probes.registered import Part
from thoughtscope.errors import BadInputError

MAX_TERMS = 32  # steering terms of one call (probes.edits re-exports it); more is a BadInputError
_MARKERS = ("Alpha", "Bravo", "Charlie", "Delta")
_PIECES: "weakref.WeakKeyDictionary[Any, list[tuple[int, ...]]]" = weakref.WeakKeyDictionary()  # tokenizer -> pieces


def special_ids(tokenizer: Any) -> set[int]:
    return {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}


def _rendered_pieces(tokenizer: Any, messages: list[dict[str, str]], special: set[int]) -> list[tuple[int, ...]]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except Exception:  # a template that refuses a role (no system turn), or a tokenizer without offsets
        return []
    spans = []
    for m in messages:
        at = text.find(m["content"])
        if at >= 0:
            spans.append((at, at + len(m["content"])))
    pieces, run = [], []
    for tid, (lo, hi) in zip(enc["input_ids"], enc["offset_mapping"]):
        inside = any(lo < b and hi > a for a, b in spans)
        if inside or (tid in special and run):  # a marker ends a run; a special token starts a new one
            if run and run[0] in special:
                pieces.append(tuple(run))
            run = []
        if not inside:
            run.append(int(tid))
    if run and run[0] in special:
        pieces.append(tuple(run))
    return pieces


def template_pieces(tokenizer: Any) -> list[tuple[int, ...]]:
    """The chat template's own token runs (each starting with a special token), longest first; cached per
    tokenizer. Empty for a tokenizer without a chat template (then only special ids are excluded)."""
    try:
        if tokenizer in _PIECES:
            return _PIECES[tokenizer]
    except TypeError:  # a tokenizer that cannot be weakly referenced: computed each time
        pass
    pieces: set[tuple[int, ...]] = set()
    if getattr(tokenizer, "chat_template", None):
        special = special_ids(tokenizer)
        a, b, c, d = _MARKERS
        for messages in ([{"role": "user", "content": a}, {"role": "assistant", "content": b},
                          {"role": "user", "content": c}],
                         [{"role": "system", "content": d}, {"role": "user", "content": a}]):
            pieces.update(_rendered_pieces(tokenizer, messages, special))
    found = sorted(pieces, key=len, reverse=True)
    try:
        _PIECES[tokenizer] = found
    except TypeError:
        pass
    return found


def excluded_positions(tokenizer: Any, ids: Sequence[int]) -> set[int]:
    """Positions of `ids` that steering skips by default: special tokens and chat-template pieces."""
    special = special_ids(tokenizer)
    out = {p for p, t in enumerate(ids) if int(t) in special}
    ids = [int(t) for t in ids]
    for piece in template_pieces(tokenizer):
        n = len(piece)
        for p in range(len(ids) - n + 1):
            if ids[p] == piece[0] and tuple(ids[p:p + n]) == piece:
                out.update(range(p, p + n))
    return out


class SteerRun(Part):
    """One call's steering (`probes.calls.Call.part`, shared by its `SteerEdit`s): a forward pre-hook on the
    model reads the row positions, validity and token ids of the forward in flight, so each term's mask
    [batch, seq] is known before any site runs; `apply` edits where the mask holds and reports the norm
    added. Prompt lengths come from the call (a generation) or from the first forward (a teacher-forced
    pass: the whole text). While `shadow` is set (frozen attention's unsteered forward) no term acts."""

    KEY = "steering"

    def __init__(self, call: Any):
        super().__init__()
        self.call, self.handle = call, call.handle
        self.members: list[Any] = []
        self._special = torch.tensor(sorted(special_ids(self.handle.tokenizer)) or [-1])
        self.prompt_lens: list[int] | None = None
        self.prompt_ids: list[dict[int, int]] = []  # per row: prompt position -> token id seen so far
        self.excluded: list[set[int]] = []
        self.masks: dict[int, torch.Tensor] = {}  # id(term) -> bool [batch, seq] of the forward in flight
        self.shadow = False
        self._hook: Any = None

    def checked(self, call: Any) -> None:
        if len(self.members) > MAX_TERMS:
            raise BadInputError(f"the steering stack has {len(self.members)} terms; at most {MAX_TERMS} are allowed")
        names = [m.name() for m in self.members]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise BadInputError(f"steering terms need distinct names (term=); {dupes} name more than one term")
        rows = call.batch_rows if call.batch_rows is not None else call.rows  # a teacher-forced pass: its rows
        for m in self.members:
            count = m.per_row_count()
            if count is not None and count != rows:
                raise BadInputError(f"{m.name()} has {count} per-row strengths but the call runs {rows} rows")
            if m.rows is not None and max(m.rows) >= rows:
                raise BadInputError(f"{m.name()} names rows {m.rows} but the call runs {rows} rows")

    def open(self) -> None:
        self._hook = self.handle.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:  # from input embeddings (gradients, a VLM's merged inputs): no token ids
            ids = torch.full(kwargs["inputs_embeds"].shape[:2], -1, dtype=torch.long)
        ids = ids.cpu()
        batch, seq = ids.shape
        pos = kwargs.get("position_ids")
        if pos is None:
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            start = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
            pos = torch.arange(start, start + seq).expand(batch, seq)
        pos = pos.cpu()
        if pos.ndim == 3:  # Qwen2-VL's 3-D rotary positions: the text axis
            pos = pos[0]
        valid = kwargs.get("attention_mask")
        valid = valid[:, -seq:].cpu().bool() if isinstance(valid, torch.Tensor) and valid.ndim == 2 else \
            torch.ones(batch, seq, dtype=torch.bool)
        if self.prompt_lens is None:
            lengths = list(self.call.lengths) if self.call.mode == "generate" else []
            if len(lengths) != batch:  # a teacher-forced pass: the first forward holds each row's whole text
                lengths = [int(p[v].max()) + 1 if v.any() else 0 for p, v in zip(pos, valid)]
            self.prompt_lens = lengths
            self.prompt_ids = [{} for _ in range(batch)]
            self.excluded = [set() for _ in range(batch)]
        self._note_prompt(ids, pos, valid)
        self.masks = {id(m): self._mask(m, ids, pos, valid) for m in self.members}

    def _note_prompt(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the prompt tokens this forward shows; recompute a row's excluded positions when it shows some."""
        for b in range(min(ids.shape[0], len(self.prompt_lens))):
            new = {int(p): int(t) for p, t, v in zip(pos[b].tolist(), ids[b].tolist(), valid[b].tolist())
                   if v and p < self.prompt_lens[b] and t >= 0}
            if new:
                self.prompt_ids[b].update(new)
                seen = self.prompt_ids[b]
                first = min(seen)
                row = [seen[p] for p in range(first, max(seen) + 1) if p in seen]
                self.excluded[b] = {first + p for p in excluded_positions(self.handle.tokenizer, row)}

    def _mask(self, term: Any, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        batch = ids.shape[0]
        if len(self.prompt_lens) != batch:
            raise BadInputError(f"the steering run knows {len(self.prompt_lens)} rows but a forward has {batch}")
        plen = torch.tensor(self.prompt_lens).view(-1, 1)
        mask = valid.clone()
        if term.tokens == "prompt":
            mask &= pos < plen
        elif term.tokens == "generated":
            mask &= pos >= plen
        if term.start is not None:
            mask &= pos >= term.start
        if term.stop is not None:
            mask &= pos < term.stop
        if term.skip_special:
            mask &= ~torch.isin(ids, self._special)
            for b in range(batch):
                if self.excluded[b]:
                    skip = torch.tensor([int(p) in self.excluded[b] for p in pos[b].tolist()], dtype=torch.bool)
                    mask[b] &= ~skip
        if term.rows is not None:
            chosen = torch.zeros(batch, dtype=torch.bool)
            chosen[[r for r in term.rows if r < batch]] = True
            mask &= chosen.view(-1, 1)
        return mask

    def apply(self, term: Any, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`view` [batch, seq, d] with `term` applied where its mask holds, the L2 norm it added [batch, seq]
        with NaN where it did not act: the report for the records, `ForwardContext.fire`)."""
        if self.shadow:
            return view, None
        mask = self.masks.get(id(term))
        if mask is None or mask.shape != view.shape[:2]:
            raise BadInputError(f"{term.name()} ran in a forward the steering run did not see; this call path "
                                "does not support steering edits")
        on = mask.to(view.device).unsqueeze(-1)
        out = torch.where(on, term.steer(view, term.strength_factor(view)), view)
        norm = (out - view).float().norm(dim=-1).cpu()
        return out, norm.masked_fill(~mask, float("nan"))

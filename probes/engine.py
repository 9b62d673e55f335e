"""The engine: instrumented streaming generation, teacher-forced traces and KV-state forks.

`Engine.generate` runs its own KV-cached decoding loop and yields one `TokenRecord` per new token
(id, text, log-prob, entropy of the full next-token distribution, top-k alternatives, captured
activations at the new position, interventions applied). The prefix is never re-run: each step
feeds only the new token. `Engine.trace` is one teacher-forced pass over all positions.
`Engine.prefill` + `Engine.fork` continue from a saved KV state, so a probe that appends a short
suffix to a long prefix costs only the suffix.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> records = list(engine.generate("2 + 2 =", max_new_tokens=3, capture=["resid_post.1"]))
    >>> len(records), records[0].activations["resid_post.1"].shape
    (3, torch.Size([64]))
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from thoughtscope.errors import BadInputError
from probes.hooks import HookRunner
from probes.interventions import Intervention, MaskAttention
from probes.records import TokenRecord, Trace
from probes.sites import Site, get_module, list_sites, validate_site
from probes.zoo import ModelHandle, load_model

Prompt = str | list[dict[str, str]] | list[int]
MAX_NEW_TOKENS_LIMIT = 8192
MAX_PROMPT_CHARS = 200_000


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. temperature 0 is greedy; otherwise top-k then top-p filtering."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadInputError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise BadInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadInputError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        return "greedy" if self.greedy else f"T={self.temperature:g}, top_p={self.top_p:g}, top_k={self.top_k}"


@dataclass
class PrefixState:
    """A sequence whose first `cache.get_seq_length()` tokens are already in the KV cache."""

    ids: list[int]
    cache: Any

    @property
    def cache_len(self) -> int:
        return self.cache.get_seq_length()


@dataclass
class _Step:
    """Per-batch bookkeeping of a generation in flight."""

    ids: list[list[int]]
    mask: torch.Tensor
    positions: torch.Tensor
    finished: list[bool]
    texts: list[str] = field(default_factory=list)


class GenerationStream(Iterator[TokenRecord]):
    """Iterator of `TokenRecord`s; between records, `state()` exposes the live KV state for `fork`."""

    def __init__(self, engine: "Engine", run: Iterator[TokenRecord]):
        self._engine, self._run = engine, run
        self.step: _Step | None = None
        self.cache: Any = None
        self.records: list[TokenRecord] = []

    def __next__(self) -> TokenRecord:
        rec = next(self._run)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        self._run.close()

    def text(self, batch_index: int = 0) -> str:
        return self.step.texts[batch_index] if self.step else ""

    def state(self) -> PrefixState:
        """The live state of a batch-of-one generation (every token so far, the cache holding them)."""
        if self.step is None or len(self.step.ids) != 1:
            raise BadInputError("fork from a live generation needs a batch of one, after its first token")
        return PrefixState(list(self.step.ids[0]), self.cache)


class Engine:
    """Drives one model: generate (streaming), trace, prefill/fork. Also the in-process `Backend`."""

    def __init__(self, handle: ModelHandle):
        self.handle = handle
        self.model = handle.model
        self.tok = handle.tokenizer
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.eos_ids = self._eos_ids()
        # One model, many callers (browser tabs run in threads): hooks are registered on the shared
        # module, so calls must not interleave. Re-entrant, so a fork inside a live generation works.
        self.lock = threading.RLock()

    @classmethod
    def from_id(cls, model_id: str = "smollm2-135m", **kwargs: Any) -> "Engine":
        return cls(load_model(model_id, **kwargs))

    # ----- the Backend protocol's read-only part -----

    def info(self) -> dict[str, Any]:
        return self.handle.info()

    def sites(self) -> list[dict[str, Any]]:
        return list_sites(self.handle.arch)

    # ----- input checks: all of them run before any model work -----

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Prompt -> token ids. A string is raw text unless `chat`; a list of dicts is chat messages."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list):
            text = self.handle.render_chat(prompt)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise BadInputError("the prompt is empty; type a question or pick an example")
            if len(prompt) > MAX_PROMPT_CHARS:
                raise BadInputError(f"the prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
            if chat:
                text = self.handle.render_chat([{"role": "user", "content": prompt}])
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tok(prompt)["input_ids"]
        else:
            raise BadInputError(f"a prompt is text, chat messages or token ids, not {type(prompt).__name__}")
        if not ids:
            raise BadInputError("the prompt encodes to no tokens")
        ctx = self.handle.arch.context_length
        if len(ids) >= ctx:
            raise BadInputError(f"the prompt has {len(ids)} tokens; this model's context is {ctx}: shorten it")
        return ids

    def _check_sites(self, capture: Sequence[str]) -> list[Site]:
        return [validate_site(name, self.handle.arch) for name in capture]

    def _split_interventions(self, interventions: Sequence[Any]) -> tuple[list[Intervention], list[MaskAttention]]:
        hooks, masks = [], []
        for iv in interventions:
            if isinstance(iv, MaskAttention):
                iv.validate(self.handle.arch)
                masks.append(iv)
            elif isinstance(iv, Intervention):
                iv.validate(self.handle.arch)
                hooks.append(iv)
            else:
                raise BadInputError(f"{iv!r} is not an intervention (see probes.interventions)")
        return hooks, masks

    # ----- generation -----

    def generate(
        self,
        prompt: Prompt | None = None,
        *,
        prompts: Sequence[Prompt] | None = None,
        n_samples: int = 1,
        max_new_tokens: int = 64,
        sampling: Sampling | None = None,
        seed: int = 0,
        capture: Sequence[str] = (),
        interventions: Sequence[Any] = (),
        top_k: int = 5,
        stop: Sequence[str] = (),
        chat: bool = False,
    ) -> GenerationStream:
        """Stream one `TokenRecord` per new token, for one prompt or a batch (`prompts`, `n_samples` each).

        Records of a batch come step by step: at each step one record per unfinished sequence.
        """
        self._local_only("streaming generation")
        if (prompt is None) == (prompts is None):
            raise BadInputError("pass either prompt= or prompts=")
        batch_prompts = [prompt] if prompts is None else list(prompts)
        if not batch_prompts or n_samples < 1:
            raise BadInputError("nothing to generate: give at least one prompt and n_samples >= 1")
        ids = [self.encode(p, chat=chat) for p in batch_prompts for _ in range(n_samples)]
        if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise BadInputError(f"max_new_tokens must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, got {max_new_tokens}")
        max_new_tokens = min(max_new_tokens, self.handle.arch.context_length - max(map(len, ids)))
        sites = self._check_sites(capture)
        hooks, masks = self._split_interventions(interventions)
        stream = GenerationStream(self, iter(()))
        run = self._generate(stream, ids, max_new_tokens, sampling or Sampling(), seed, sites, hooks, masks,
                             top_k, tuple(stop))
        stream._run = run
        return stream

    def _generate(self, *args):
        with self.lock:
            yield from self._generate_unlocked(*args)

    @torch.no_grad()
    def _generate_unlocked(self, stream, ids, max_new, sampling, seed, sites, hooks, masks, top_k, stop):
        device = self.handle.device
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        described = [iv.describe() for iv in [*hooks, *masks]]
        input_ids, mask, masked_cols = self._left_pad(ids, masks)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        step = _Step([list(x) for x in ids], mask, positions, [False] * len(ids), [""] * len(ids))
        stream.step = step
        cache = self._new_cache()
        with HookRunner(self.handle, sites, hooks) as runner:
            runner.ctx.batch, runner.ctx.last_only = len(ids), True
            # With attention masking, the last prompt token is fed as a decode step so that it,
            # too, sees the mask (it predicts the first generated token).
            split = 1 if masks else 0
            runner.ctx.phase, runner.ctx.seq = ("context" if split else "prefill"), input_ids.shape[1] - split
            if split and input_ids.shape[1] > 1:
                self._forward(input_ids[:, :-1], mask[:, :-1], positions[:, :-1], cache)
                feed = input_ids[:, -1:]
            else:
                feed = input_ids
            feed_mask = mask.clone()
            if split:
                feed_mask[:, masked_cols] = 0
                runner.ctx.phase = "decode"
            logits = self._forward(feed, feed_mask, positions[:, -feed.shape[1]:], cache)
            stream.cache = cache
            for t in range(max_new):
                next_ids, recs = self._step_records(logits, sampling, gen, top_k, step, t, runner, described)
                done_now = t == max_new - 1
                for rec in recs:
                    b = rec.batch_index
                    step.ids[b].append(rec.token_id)
                    step.texts[b] += rec.text
                    rec.finished = done_now or rec.token_id in self.eos_ids or any(s in step.texts[b] for s in stop)
                    step.finished[b] = rec.finished
                for rec in recs:
                    yield rec
                if all(step.finished):
                    return
                new_col = torch.ones(len(ids), 1, dtype=step.mask.dtype, device=device)
                step.mask = torch.cat([step.mask, new_col], dim=1)
                step.positions = step.positions[:, -1:] + 1
                feed_mask = step.mask.clone()
                if masks:
                    feed_mask[:, masked_cols] = 0
                runner.ctx.phase, runner.ctx.seq = "decode", 1
                logits = self._forward(next_ids.view(-1, 1), feed_mask, step.positions, cache)

    def _step_records(self, logits, sampling, gen, top_k, step, t, runner, described):
        """Choose the next tokens and build one record per unfinished sequence."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        next_ids = self._choose(logits, logp, sampling, gen)
        chosen_lp = logp.gather(-1, next_ids.view(-1, 1)).squeeze(-1)
        k = min(top_k, logp.shape[-1])
        top_lp, top_ix = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        ent, lp, nid = entropy.tolist(), chosen_lp.tolist(), next_ids.tolist()
        tops, top_p = top_ix.tolist(), top_lp.exp().tolist()
        acts = {name: v[:, -1] for name, v in runner.captured.items()}
        records = []
        for b in range(len(nid)):
            if step.finished[b]:
                continue
            records.append(TokenRecord(
                step=t, batch_index=b, token_id=nid[b], text=self._piece(step.ids[b], nid[b]),
                logprob=lp[b], entropy=ent[b], top_ids=tops[b],
                top_tokens=[self.tok.decode([i]) for i in tops[b]], top_probs=top_p[b],
                activations={name: v[b] for name, v in acts.items()}, interventions=described,
            ))
        return next_ids, records

    def _choose(self, logits: torch.Tensor, logp: torch.Tensor, sampling: Sampling, gen: torch.Generator):
        if sampling.greedy:
            return logits.argmax(-1)
        scores = logits.float() / sampling.temperature
        if sampling.top_k:
            kth = scores.topk(min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if sampling.top_p < 1:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop = cum - sorted_scores.softmax(-1) > sampling.top_p  # keep the token that crosses top_p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, -math.inf))
        probs = scores.softmax(-1).cpu()
        return torch.multinomial(probs, 1, generator=gen).view(-1).to(logits.device)

    def _piece(self, ids: list[int], new_id: int) -> str:
        """Text the new token adds; decoding a short window keeps multi-byte characters whole."""
        window = ids[-6:]
        before = self.tok.decode(window, skip_special_tokens=False)
        after = self.tok.decode(window + [new_id], skip_special_tokens=False)
        return after[len(before):] if after.startswith(before) else self.tok.decode([new_id])

    # ----- teacher-forced passes -----

    @torch.no_grad()
    def trace(self, text: Prompt, capture: Sequence[str] = (), interventions: Sequence[Any] = (),
              chat: bool = False) -> Trace:
        """One teacher-forced pass over `text`: all positions' activations, log-probs and entropies."""
        ids = self.encode(text, chat=chat)
        sites = self._check_sites(capture)
        hooks, masks = self._split_interventions(interventions)
        if masks:
            raise BadInputError("MaskAttention applies to generated tokens; use it with generate()")
        acts, logits = self._capture_forward(ids, sites, hooks)
        input_ids = torch.tensor([ids], device=logits.device)
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropies = -(logp.exp() * logp).sum(-1)
        token_lp = torch.full((len(ids),), float("nan"))
        if len(ids) > 1:
            token_lp[1:] = logp[:-1].gather(-1, input_ids[0, 1:].view(-1, 1)).squeeze(-1).cpu()
        return Trace(
            text=text if isinstance(text, str) else self.tok.decode(ids), token_ids=ids,
            tokens=[self.tok.decode([i]) for i in ids], activations=acts,
            logprobs=token_lp, entropies=entropies.cpu(),
        )

    @torch.no_grad()
    def capture_batch(self, sequences: Sequence[list[int]], capture: Sequence[str],
                      prefix: PrefixState | None = None, stop_after_last_site: bool = True) -> dict[str, torch.Tensor]:
        """Teacher-forced pass over a batch of token sequences: {site: [batch, width, ...]}.

        Every sequence must start with `prefix.ids` when a prefix is given: its KV cache is reused
        and only the tails run (right-padded to `width`, the longest tail). With
        `stop_after_last_site` the forward ends after the deepest captured layer and no logits
        are computed, which is what harvesting step vectors needs.
        """
        self._local_only("capture_batch")
        if not sequences:
            raise BadInputError("capture_batch needs at least one sequence")
        sites = self._check_sites(capture)
        shared = len(prefix.ids) if prefix is not None else 0
        if prefix is not None and any(list(seq[:shared]) != prefix.ids for seq in sequences):
            raise BadInputError("every sequence must start with the prefix's tokens")
        dev = self.handle.device
        width = max(len(seq) for seq in sequences) - shared
        if width < 1:
            raise BadInputError("the sequences hold no tokens beyond the prefix")
        input_ids = torch.full((len(sequences), width), self.tok.pad_token_id or 0, dtype=torch.long, device=dev)
        mask = torch.zeros((len(sequences), shared + width), dtype=torch.long, device=dev)
        mask[:, :shared] = 1
        for b, seq in enumerate(sequences):
            tail = list(seq[shared:])
            input_ids[b, :len(tail)] = torch.tensor(tail, device=dev)
            mask[b, shared:shared + len(tail)] = 1
        kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=mask, logits_to_keep=1,
                                      position_ids=torch.arange(shared, shared + width, device=dev).expand(len(sequences), -1))
        if prefix is not None:
            import copy

            cache = copy.deepcopy(prefix.cache)
            _rollback(cache, shared)
            cache.batch_repeat_interleave(len(sequences))
            kwargs.update(use_cache=True, **{self._cache_kw: cache})
        else:
            kwargs["use_cache"] = False
        deepest = max((s.layer for s in sites if s.layer is not None), default=None)
        stop_early = stop_after_last_site and deepest is not None and all(s.layer is not None for s in sites)
        with self.lock, HookRunner(self.handle, sites, []) as runner:
            runner.ctx.batch, runner.ctx.seq, runner.ctx.phase = len(sequences), width, "trace"
            stopper = None
            if stop_early:
                last = get_module(self.model, Site("resid_post", deepest).module_path(self.handle.family))
                stopper = last.register_forward_hook(_stop_forward)  # after the runner's hooks: capture first
            try:
                self.model(**kwargs)
            except _EnoughLayers:
                pass
            finally:
                if stopper is not None:
                    stopper.remove()
            return dict(runner.captured)

    @torch.no_grad()
    def capture(self, text: Prompt, capture: Sequence[str], interventions: Sequence[Any] = (),
                chat: bool = False) -> dict[str, torch.Tensor]:
        """One forward, the named sites out: {site: [seq, ...]}. `trace` without the statistics.

        >>> acts = Engine.from_id("tiny-random:llama").capture("hello world", ["resid_post.0"])
        >>> acts["resid_post.0"].shape
        torch.Size([2, 64])
        """
        ids = self.encode(text, chat=chat)
        sites = self._check_sites(capture)
        hooks, masks = self._split_interventions(interventions)
        if masks:
            raise BadInputError("MaskAttention applies to generated tokens; use it with generate()")
        return self._capture_forward(ids, sites, hooks)[0]

    def _capture_forward(self, ids: list[int], sites: list[Site], hooks: list[Intervention]):
        """(activations {site: [seq, ...]}, logits [seq, vocab]) of one teacher-forced forward."""
        if self.handle.remote:
            return self._remote_trace(ids, sites, hooks)
        input_ids = torch.tensor([ids], device=self.handle.device)
        with self.lock, HookRunner(self.handle, sites, hooks) as runner:
            runner.ctx.batch, runner.ctx.seq, runner.ctx.phase = 1, len(ids), "trace"
            logits = self.model(input_ids=input_ids, use_cache=False).logits[0]
        return {name: v[0] for name, v in runner.captured.items()}, logits

    def _remote_trace(self, ids: list[int], sites: list[Site], hooks: list[Intervention]):
        """A trace of an `ndif:` model: the same sites read through nnsight's remote execution."""
        from probes.remote import nnsight_capture

        if hooks:
            raise BadInputError("interventions on ndif: models are not supported; trace without them, "
                                "or load the model locally with hf:")
        acts = nnsight_capture(self.handle, ids, sites, remote=True)
        logits = acts["logits"] if any(s.name == "logits" for s in sites) else acts.pop("logits")
        return acts, logits

    def _local_only(self, what: str) -> None:
        if self.handle.remote:
            raise BadInputError(f"{what} needs the weights in this process; {self.handle.model_id} runs on NDIF, "
                                "where only trace() is available (or handle.nnsight with remote=True)")

    @torch.no_grad()
    def head_means(self, texts: Sequence[str], layer: int) -> torch.Tensor:
        """Mean per-head attention output `z.layer` over all positions of `texts` (for mean ablation)."""
        site = f"z.{layer}"
        rows = [self.trace(t, capture=[site]).activations[site] for t in texts]
        return torch.cat(rows).mean(0)

    # ----- KV-state forks -----

    @torch.no_grad()
    def prefill(self, prompt: Prompt, chat: bool = False) -> PrefixState:
        """Run a prefix once and keep its KV cache for any number of `fork`s."""
        self._local_only("prefill")
        ids = self.encode(prompt, chat=chat)
        cache = self._new_cache()
        t = torch.tensor([ids], device=self.handle.device)
        with self.lock:
            self._forward(t, torch.ones_like(t), torch.arange(len(ids), device=t.device).view(1, -1), cache)
        return PrefixState(ids, cache)

    @torch.no_grad()
    def fork(self, state: PrefixState, suffix: str | list[int], max_new_tokens: int = 16,
             capture: Sequence[str] = (), top_k: int = 5, stop: Sequence[str] = ()) -> list[TokenRecord]:
        """Append `suffix` to a saved state and decode greedily; the state is left as it was.

        Costs the tokens not yet in the cache plus the suffix plus the decoded tokens, never the prefix.
        """
        suffix_ids = suffix if isinstance(suffix, list) else self.tok(suffix, add_special_tokens=False)["input_ids"]
        sites = self._check_sites(capture)
        base_len = state.cache_len
        todo = state.ids[base_len:] + list(suffix_ids)
        if not todo:
            raise BadInputError("fork needs a non-empty suffix")
        max_new_tokens = min(max_new_tokens, self.handle.arch.context_length - len(state.ids) - len(suffix_ids))
        if max_new_tokens < 1:
            raise BadInputError("the prefix and suffix already fill the model's context")
        cache, dev = _forkable(state.cache), self.handle.device
        seq = list(state.ids) + list(suffix_ids)
        step = _Step([seq], torch.ones(1, len(seq), dtype=torch.long, device=dev), None, [False], [""])
        records: list[TokenRecord] = []
        try:
            with self.lock, HookRunner(self.handle, sites, []) as runner:
                runner.ctx.last_only, runner.ctx.phase = True, "decode"
                feed = torch.tensor([todo], device=dev)
                pos = torch.arange(base_len, len(seq), device=dev).view(1, -1)
                logits = self._forward(feed, step.mask, pos, cache)
                for t in range(max_new_tokens):
                    next_ids, recs = self._step_records(logits, Sampling(), None, top_k, step, t, runner, [])
                    rec = recs[0]
                    seq.append(rec.token_id)
                    step.texts[0] += rec.text
                    rec.finished = (t == max_new_tokens - 1 or rec.token_id in self.eos_ids
                                    or any(s in step.texts[0] for s in stop))
                    records.append(rec)
                    if rec.finished:
                        break
                    step.mask = torch.ones(1, len(seq), dtype=torch.long, device=dev)
                    logits = self._forward(next_ids.view(1, 1), step.mask,
                                           torch.tensor([[len(seq) - 1]], device=dev), cache)
        finally:
            _rollback(cache, base_len)
        return records

    # ----- plumbing -----

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, input_ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1]

    def _left_pad(self, ids: list[list[int]], masks: list[MaskAttention]):
        """Left-pad a batch; return ids, attention mask and the masked columns (MaskAttention)."""
        width = max(map(len, ids))
        pad = self.tok.pad_token_id
        dev = self.handle.device
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long, device=dev)
        mask = torch.zeros((len(ids), width), dtype=torch.long, device=dev)
        for b, row in enumerate(ids):
            input_ids[b, width - len(row):] = torch.tensor(row, device=dev)
            mask[b, width - len(row):] = 1
        cols: list[int] = []
        for m in masks:
            for p in m.positions:
                if any(p >= len(row) for row in ids):
                    raise BadInputError(f"MaskAttention position {p} is beyond a prompt of {min(map(len, ids))} tokens")
        if masks:
            if len({len(r) for r in ids}) != 1:
                raise BadInputError("MaskAttention needs prompts of equal length in a batch")
            cols = sorted({p for m in masks for p in m.positions})
        return input_ids, mask, cols

    def _eos_ids(self) -> set[int]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tok.eos_token_id is not None:
            ids.add(self.tok.eos_token_id)
        return ids


def _forkable(cache: Any) -> Any:
    """The cache itself when it can be rolled back after a fork, else a copy (sliding-window layers
    drop old states, so their rollback is impossible)."""
    import copy

    layers = getattr(cache, "layers", [])
    if any("Sliding" in type(layer).__name__ for layer in layers):
        return copy.deepcopy(cache)
    return cache


def _rollback(cache: Any, length: int) -> None:
    """Drop every cached position at or beyond `length` (transformers 5 wants a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class _EnoughLayers(Exception):
    """Raised by a hook to end a forward once the deepest wanted layer has run."""


def _stop_forward(*_: Any) -> None:
    raise _EnoughLayers

"""The engine: instrumented streaming generation, teacher-forced traces and KV-state forks.

`Engine.generate` runs its own KV-cached decoding loop and yields one `TokenRecord` per new token
(id, text, log-prob, entropy of the full next-token distribution, top-k alternatives, captured
activations at the new position, interventions applied). The prefix is never re-run: each step
feeds only the new token. `Engine.trace` is one teacher-forced pass over all positions.
`Engine.prefill` + `Engine.fork` continue from a saved KV state, so a probe that appends a short
suffix to a long prefix costs only the suffix; a fork never changes the state it starts from (it
reads a view of the cache), and `prefill(..., base=state)` extends a state by computing only the
new tokens.

The engine is the in-process `Backend` (probes.backend): everything a method needs, from
tokenizer operations to readouts and gradient fits, is a method here and an endpoint of the model
server, so an analysis never reaches into the model.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> records = list(engine.generate("2 + 2 =", max_new_tokens=3, capture=["resid_post.1"]))
    >>> len(records), records[0].activations["resid_post.1"].shape
    (3, torch.Size([64]))
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from probes import attention_masks, interventions, kv_policies, routing  # noqa: F401  (importing registers every wire kind)
from probes import attention_rows, cancel
from probes.calls import Call
from probes.kv_cache import kv_bytes_per_sequence
from probes.memory_budget import check_call as check_memory
from probes.memory_budget import check_handle as check_memory_of
from probes.records import Readout, TokenRecord, Trace
from probes.sampling import Sampling  # noqa: F401  (re-exported: probes.Sampling, probes.engine.Sampling)
from probes.sites import FAMILIES, Site, get_module, list_sites, validate_site
from probes.tokens import MAX_PROMPT_CHARS, Prompt, TokenizerOps  # noqa: F401  (MAX_PROMPT_CHARS re-exported)
from probes.zoo import ArchInfo, ModelHandle, load_model
from thoughtscope import checks
from thoughtscope.errors import BadInputError

MAX_NEW_TOKENS_LIMIT = 8192
MAX_READOUT_ROWS = 65_536

# What a backend can do (`capabilities()`): a page declares what it needs from this list.
CAPABILITIES = ("generate", "trace", "interventions", "fork", "capture_batch", "readout", "grad", "attention",
                "kv_policy", "router", "vision", "head_gates", "frozen_attention")


@dataclass
class PrefixState:
    """A sequence whose first `cache_len` tokens are already in the KV cache (an in-process prefix state).

    Methods use only `ids` and hand the state back to `fork`/`prefill(base=)`/`free`; the model
    server keeps these under `id` and a client holds a `RemotePrefix` with the same fields.
    """

    ids: list[int]
    cache: Any = field(repr=False)
    fingerprint: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def cache_len(self) -> int:
        if self.cache is None:
            raise BadInputError(f"prefix state {self.id} was freed; prefill again")
        return self.cache.get_seq_length()

    @property
    def n_bytes(self) -> int:
        """Bytes the cached keys and values hold (what a server's state budget counts)."""
        if self.cache is None:
            return 0
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def describe(self) -> dict[str, Any]:
        return {"state_id": self.id, "ids": list(self.ids), "fingerprint": self.fingerprint,
                "n_tokens": len(self.ids), "n_bytes": self.n_bytes}


def _check_stop(stop: Sequence[str]) -> None:
    if isinstance(stop, str) or any(not isinstance(x, str) or not x for x in stop):
        raise BadInputError("stop must be a list of non-empty strings (an empty one would end every generation at "
                            "once)")


def check_seed(seed: Any) -> int:
    """A seed torch accepts: an integer in 0..2**63 - 1."""
    return checks.integer("the seed", seed, low=0, high=2**63 - 1)


@dataclass
class _Step:
    """Per-batch bookkeeping of a generation in flight."""

    ids: list[list[int]]
    mask: torch.Tensor
    positions: torch.Tensor
    finished: list[bool]
    texts: list[str] = field(default_factory=list)


class ModelLock:
    """The engine's lock: re-entrant per thread, and a streamed generation's hold can be released by any thread.

    A generation holds the lock from its first record to its end. A consumer that stops early
    without `close()` (an exception out of its loop: a stopped job) leaves the generator to be
    finalised wherever it is freed: by reference counting in the consumer's thread, or by the
    garbage collector in whichever thread runs it. `threading.RLock` refuses a release from
    another thread (the lock would stay held and every later call wait forever); here the
    generation releases the hold it took (`hold`/`release(owner)`), whatever thread runs its
    `finally`. `with lock:` and `acquire()`/`release()` behave as `RLock`'s.

    A caller kept waiting while a suspended generation holds the lock runs the garbage collector now
    and then (a stream abandoned inside a reference cycle is freed then, which releases its hold).
    """

    COLLECT_EVERY_S = 5.0  # how often a waiter collects while a suspended generation holds the lock

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: threading.Thread | None = None
        self._depth = 0
        self._suspended = 0  # holds of generations between records (their consumer may have left them)

    def _take(self, blocking: bool = True, timeout: float = -1) -> threading.Thread | None:
        import gc
        import time

        me = threading.current_thread()
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while True:
            with self._cond:
                while self._owner not in (None, me):
                    if not blocking:
                        return None
                    wait = self.COLLECT_EVERY_S
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            return None
                    self._cond.wait(wait)
                    if self._owner not in (None, me) and self._suspended:
                        break  # collect outside the condition (a finaliser releases through it)
                else:
                    self._owner = me
                    self._depth += 1
                    return me
            gc.collect()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._take(blocking, timeout) is not None

    def release(self, owner: threading.Thread | None = None) -> None:
        """Release one level; `owner` (from `hold`) lets another thread release a generation's hold."""
        with self._cond:
            who = threading.current_thread() if owner is None else owner
            if self._owner is not who or self._depth == 0:
                raise RuntimeError("cannot release un-acquired lock")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def hold(self) -> threading.Thread:
        """Acquire for a generation; returns the owner to pass to `release`."""
        owner = self._take()
        assert owner is not None
        return owner

    def suspended(self, delta: int) -> None:
        with self._cond:
            self._suspended += delta

    def locked(self) -> bool:
        with self._cond:
            return self._owner is not None

    def __enter__(self) -> "ModelLock":
        self._take()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


@dataclass
class _Live:
    """What a running generation shares with its stream: the generator writes it, the stream reads it.

    The generator holds this, not the stream, so stream and generator form no reference cycle: a
    stream its consumer drops is freed at once (the generator closed, the model lock released),
    not whenever the garbage collector next runs."""

    step: _Step | None = None
    cache: Any = None


class GenerationStream(Iterator[TokenRecord]):
    """Iterator of `TokenRecord`s; between records, `state()` exposes the live KV state for `fork`.

    Dropping a stream before its end (without `close()`) ends the generation and frees the model."""

    def __init__(self, engine: "Engine", run: Iterator[TokenRecord], live: _Live | None = None):
        self._engine, self._run = engine, run
        self._live = live or _Live()
        self.records: list[TokenRecord] = []

    @property
    def step(self) -> _Step | None:
        return self._live.step

    @property
    def cache(self) -> Any:
        return self._live.cache

    def __next__(self) -> TokenRecord:
        rec = next(self._run)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        self._run.close()

    def __del__(self) -> None:
        run = getattr(self, "_run", None)
        if run is not None and hasattr(run, "close"):
            run.close()

    def text(self, batch_index: int = 0) -> str:
        return self.step.texts[batch_index] if self.step else ""

    def state(self) -> PrefixState:
        """The live state of a batch-of-one generation (every token so far, the cache holding them)."""
        if self.step is None or len(self.step.ids) != 1:
            raise BadInputError("fork from a live generation needs a batch of one, after its first token")
        # a Qwen-VL generation's 3-D positions need no field here: a fork finds them from the ids (mrope_offset)
        return PrefixState(list(self.step.ids[0]), self.cache)


class Engine:
    """Drives one model: generate (streaming), trace, prefill/fork. Also the in-process `Backend`."""

    def __init__(self, handle: ModelHandle):
        self.handle = handle
        self.model = handle.model
        self.tok = handle.tokenizer
        self.ops = TokenizerOps.of(handle)
        self._eos = set(self.ops.eos_ids())
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        # One model, many callers (browser tabs run in threads): hooks are registered on the shared
        # module, so calls must not interleave. Re-entrant, so a fork inside a live generation works.
        # A generation's hold is released by whichever thread finalises it (ModelLock).
        self.lock = ModelLock()

    @classmethod
    def from_id(cls, model_id: str = "smollm2-135m", **kwargs: Any) -> "Engine":
        return cls(load_model(model_id, **kwargs))

    # ----- the Backend protocol's read-only part -----

    def info(self) -> dict[str, Any]:
        from probes.validate import cached_summary

        # with the model's correctness badge (probes.validate; None until validated), so the server's
        # /info and every provenance record built from info() carry it
        return {**self.handle.info(), "validation": cached_summary(self.handle)}

    def arch(self) -> ArchInfo:
        """The model's typed architecture facts (what `info()["arch"]` holds as a dict)."""
        return self.handle.arch

    def sites(self) -> list[dict[str, Any]]:
        return list_sites(self.handle.arch)

    def capabilities(self) -> dict[str, bool]:
        """What this backend can do; a page declares what it needs instead of probing with hasattr."""
        if self.handle.remote:  # an ndif: model: what its nnsight traces serve (probes.ndif.VERDICTS, with reasons)
            from probes.ndif import capability_report

            return {row["capability"]: row["verdict"] != "refused" for row in capability_report(self.handle)}
        local = True
        have = {name: local for name in CAPABILITIES}
        have["trace"] = True
        have["router"] = local and self.handle.arch.is_moe
        have["vision"] = local and bool(getattr(self.handle, "is_vlm", False))
        have["frozen_attention"] = local and not self.handle.arch.is_moe  # probes.frozen_attention (dense only)
        return have

    # ----- tokenizer operations (probes.tokens; the same code runs in RemoteBackend) -----

    def encode(self, prompt: Prompt, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        """Prompt -> token ids. A string is raw text unless `chat`; a list of dicts is chat messages;
        token ids are checked against the vocabulary. Every check runs before any model work."""
        return self.ops.encode(prompt, chat=chat, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.ops.decode(ids, skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Per-token texts that concatenate to the decoded text."""
        return self.ops.token_texts(ids)

    def eos_ids(self) -> list[int]:
        return self.ops.eos_ids()

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.ops.render_chat(messages, add_generation_prompt)

    def _check_sites(self, capture: Sequence[str]) -> list[Site]:
        return [validate_site(name, self.handle.arch) for name in capture]

    def _bind(self, mode: str, interventions: Sequence[Any], *, lengths: Sequence[int], batch_rows: int | None = None,
              capture: Sequence[Site] = (), max_new_tokens: int = 0) -> Call:
        """The per-call context with every intervention bound: each checked once, before any model work
        (`probes.calls`); the kinds install themselves when the call is entered."""
        call = Call(self.handle, mode, lengths=lengths, batch_rows=batch_rows, capture=capture,
                    max_new_tokens=max_new_tokens).bind(interventions)
        check_memory(self.handle, call)  # the estimated size against the memory budget (probes.memory_budget)
        return call

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
        images: Any = None,
    ) -> GenerationStream:
        """Stream one `TokenRecord` per new token, for one prompt or a batch (`prompts`, `n_samples` each).

        Records of a batch come step by step: at each step one record per unfinished sequence.
        A vision-language model takes `images` (probes.vision): with `prompt`, the image(s) of that
        prompt; with `prompts`, one image or list of images per prompt. The prompt holds `<image>`
        once per image; `TokenRecord`s cover the generated tokens only.
        """
        if (prompt is None) == (prompts is None):
            raise BadInputError("pass either prompt= or prompts=")
        batch_prompts = [prompt] if prompts is None else list(prompts)
        if not batch_prompts or n_samples < 1:
            raise BadInputError("nothing to generate: give at least one prompt and n_samples >= 1")
        ids = [self.encode(p, chat=chat) for p in batch_prompts for _ in range(n_samples)]
        per_prompt = None if images is None else ([images] if prompts is None else images)
        ids, vision = self._vision_inputs(ids, per_prompt, n_samples)
        check_seed(seed)
        _check_stop(stop)
        if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise BadInputError(f"max_new_tokens must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, got {max_new_tokens}")
        max_new_tokens = min(max_new_tokens, self.handle.arch.context_length - max(map(len, ids)))
        sites = self._check_sites(capture)
        # every intervention checked here, not at the first token: before any stream
        call = self._bind("generate", interventions, lengths=[len(row) for row in ids], batch_rows=len(ids),
                          capture=sites, max_new_tokens=max_new_tokens)
        if self.handle.remote:  # an ndif: model: one nnsight generate, the records after it (probes.ndif)
            return self._ndif_generate(ids, sites, max_new_tokens, sampling or Sampling(), seed, call, top_k, tuple(stop),
                                       vision)
        live = _Live()
        run = self._generate(live, ids, max_new_tokens, sampling or Sampling(), seed, call, top_k, tuple(stop), vision)
        return GenerationStream(self, run, live)

    def _generate(self, *args):
        """The decoding loop under the model lock, taken at the first record and released at the end,
        on `close()`, or when the stream is freed, in whatever thread that happens (ModelLock)."""
        owner = self.lock.hold()
        inner = self._generate_unlocked(*args)
        try:
            for rec in inner:
                self.lock.suspended(1)
                try:
                    yield rec
                finally:
                    self.lock.suspended(-1)
        finally:
            try:
                inner.close()  # hooks and masks off the model first (its ExitStack), then hand the model on
            finally:
                self.lock.release(owner)

    @torch.no_grad()
    def _generate_unlocked(self, live, ids, max_new, sampling, seed, call, top_k, stop, vision=None):
        device = self.handle.device
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        described = call.described()
        input_ids, mask = self._left_pad(ids)
        masked_cols = call.hidden_columns  # prompt columns no generated token reads (attention masks)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        flat = positions  # 2-D token positions (what an installed edit reads), also under Qwen2-VL's 3-D ones
        if vision and "image_grid_thw" in vision:  # Qwen2-VL: 3-D rotary positions [3, batch, seq] (probes.vision)
            from probes.vision import mrope_positions

            positions = mrope_positions(self.model, input_ids, mask, vision, self.handle.vision)
            vision = {k: v for k, v in vision.items() if k != "mm_token_type_ids"}  # positions are given
        pads = [input_ids.shape[1] - len(row) for row in ids]
        step = _Step([list(x) for x in ids], mask, positions, [False] * len(ids), [""] * len(ids))
        live.step = step
        cache = call.new_cache(self._new_cache)
        call.first_query = input_ids.shape[1] - 1  # queries a layer's attention masker hides keys from
        with call:
            runner = call.runner
            runner.ctx.batch, runner.ctx.last_only = len(ids), True
            runner.ctx.prompt_lengths = [len(row) for row in ids]
            # With attention masking, the last prompt token is fed as a decode step so that it,
            # too, sees the mask (it predicts the first generated token).
            split = 1 if call.feed_last_alone else 0
            runner.ctx.phase, runner.ctx.seq = ("context" if split else "prefill"), input_ids.shape[1] - split
            pixels = dict(vision or {})  # image inputs go with the first forward only (it holds the image tokens)
            if split and input_ids.shape[1] > 1:
                runner.ctx.positions = flat[:, :-1]
                self._forward(input_ids[:, :-1], mask[:, :-1], positions[..., :-1], cache, pixels)
                feed, pixels = input_ids[:, -1:], {}
            else:
                feed = input_ids
            feed_mask = mask.clone()
            if split:
                feed_mask[:, masked_cols] = 0
                runner.ctx.phase = "decode"
            runner.ctx.positions = flat[:, -feed.shape[1]:]
            logits = self._forward(feed, feed_mask, positions[..., -feed.shape[1]:], cache, pixels)
            live.cache = cache
            for t in range(max_new):
                next_ids, recs = self._step_records(logits, sampling, gen, top_k, step, t, runner, described)
                kv_bytes = kv_bytes_per_sequence(cache, pads)
                done_now = t == max_new - 1
                for rec in recs:
                    b = rec.batch_index
                    rec.kv_bytes = kv_bytes[b]
                    step.ids[b].append(rec.token_id)
                    step.texts[b] += rec.text
                    rec.finished = done_now or rec.token_id in self._eos or any(s in step.texts[b] for s in stop)
                    step.finished[b] = rec.finished
                for rec in recs:
                    yield rec
                if all(step.finished):
                    return
                new_col = torch.ones(len(ids), 1, dtype=step.mask.dtype, device=device)
                step.mask = torch.cat([step.mask, new_col], dim=1)
                step.positions = step.positions[..., -1:] + 1
                flat = flat[:, -1:] + 1
                feed_mask = step.mask.clone()
                if split:
                    feed_mask[:, masked_cols] = 0
                runner.ctx.phase, runner.ctx.seq, runner.ctx.positions = "decode", 1, flat
                logits = self._forward(next_ids.view(-1, 1), feed_mask, step.positions, cache)

    def _step_records(self, logits, sampling, gen, top_k, step, t, runner, described):
        """Choose the next tokens and build one record per unfinished sequence."""
        if not torch.isfinite(logits).all():
            raise BadInputError("the model's next-token scores became NaN or infinite"
                                + (f" under {', '.join(described)}: use a smaller scale" if described else ""))
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        next_ids = self._choose(logits, logp, sampling, gen)
        chosen_lp = logp.gather(-1, next_ids.view(-1, 1)).squeeze(-1)
        k = min(top_k, logp.shape[-1])
        top_lp, top_ix = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        ent, lp, nid = entropy.tolist(), chosen_lp.tolist(), next_ids.tolist()
        tops, top_p = top_ix.tolist(), top_lp.exp().tolist()
        acts = {name: v[:, -1] for name, v in runner.captured.items()}
        # what installed interventions reported of this forward: each row's value at its last position
        fired = {name: v[:, -1].tolist() for name, v in runner.ctx.take_fired().items()}
        records = []
        for b in range(len(nid)):
            if step.finished[b]:
                continue
            records.append(TokenRecord(
                step=t, batch_index=b, token_id=nid[b], text=self._piece(step.ids[b], nid[b]),
                logprob=lp[b], entropy=ent[b], top_ids=tops[b],
                top_tokens=[self.tok.decode([i]) for i in tops[b]], top_probs=top_p[b],
                activations={name: v[b] for name, v in acts.items()}, interventions=described,
                fired={name: per_row[b] for name, per_row in fired.items() if not math.isnan(per_row[b])},
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
        return self.ops.piece(ids, new_id)

    # ----- teacher-forced passes -----

    @torch.no_grad()
    def trace(self, text: Prompt, capture: Sequence[str] = (), interventions: Sequence[Any] = (),
              chat: bool = False, images: Sequence[Any] | None = None) -> Trace:
        """One teacher-forced pass over `text`: all positions' activations, log-probs and entropies.

        With `images` (a VLM; probes.vision) each `<image>` in `text` becomes the image's tokens:
        `token_ids` and every per-position row include them (`probes.vision.box_tokens` finds a region's).
        With `RowMask` interventions (probes.attention_masks) the text runs once per row in one batched
        forward, each row under its own masks, and logprobs/entropies/activations get a leading row axis.
        """
        ids = self.encode(text, chat=chat)
        (ids,), vision = self._vision_inputs([ids], None if images is None else [images])
        sites = self._check_sites(capture)
        call = self._bind("trace", interventions, lengths=[len(ids)], capture=sites)
        n_rows = call.rows
        acts, logits = self._capture_forward(ids, sites, call, vision)
        fired = call.runner.ctx.take_fired()
        logits = logits if n_rows > 1 else logits.unsqueeze(0)
        input_ids = torch.tensor([ids], device=logits.device)
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropies = -(logp.exp() * logp).sum(-1)
        token_lp = torch.full((n_rows, len(ids)), float("nan"))
        if len(ids) > 1:
            index = input_ids[:, 1:].unsqueeze(-1).expand(n_rows, -1, 1)
            token_lp[:, 1:] = logp[:, :-1].gather(-1, index).squeeze(-1).cpu()
        if n_rows == 1:
            token_lp, entropies = token_lp[0], entropies[0]
        return Trace(
            text=text if isinstance(text, str) else self.tok.decode(ids), token_ids=ids,
            tokens=[self.tok.decode([i]) for i in ids], activations=acts,
            logprobs=token_lp, entropies=entropies.cpu(),
            fired={name: v if n_rows > 1 else v[0] for name, v in fired.items()},
        )

    @torch.no_grad()
    def capture_batch(self, sequences: Sequence[list[int]], capture: Sequence[str],
                      prefix: PrefixState | None = None, stop_after_last_site: bool = True,
                      positions: Sequence[Sequence[int]] | None = None,
                      interventions: Sequence[Any] = (), images: Any = None) -> dict[str, torch.Tensor]:
        """Teacher-forced pass over a batch of token sequences: {site: [batch, width, ...]}.

        Every sequence must start with `prefix.ids` when a prefix is given: its KV cache is reused
        (never changed) and only the tails run (right-padded to `width`, the longest tail). With
        `stop_after_last_site` the forward ends after the deepest captured layer and no logits
        are computed, which is what harvesting step vectors needs. With `positions` (absolute
        token indices, one list per sequence, each past the prefix) only those rows come back,
        concatenated: {site: [sum of len(positions[b]), ...]} — what a server should ship.
        `interventions` apply to every sequence (MaskAttention positions are absolute token indices).
        A vision-language model takes `images`: one entry per sequence (an image, a list of images, or
        None for a row without one), each image's placeholder in its sequence expanded into its image
        tokens (`positions` index the expanded sequences; ids already expanded stay as they are).
        Rows with images run without a prefix (a prefix state holding an image is fine: its tails are text).
        """
        if not sequences:
            raise BadInputError("capture_batch needs at least one sequence")
        sequences = [self.encode(list(seq)) for seq in sequences]
        vision: dict[str, Any] = {}
        if images is not None:
            if prefix is not None:
                raise BadInputError("capture_batch with images runs without a prefix: prefill the prefix with its "
                                    "images instead, and give text tails")
            sequences, vision = self._vision_inputs(sequences, images)
        else:  # image tokens past the prefix would run without their pixels
            skip = len(prefix.ids) if prefix is not None else 0
            self._refuse_image_tokens([t for seq in sequences for t in seq[skip:]], "capture_batch without images")
        sites = self._check_sites(capture)
        # patterns read at chosen rows only: computed as rows (probes.attention_rows), never as seq x seq
        pattern_sites = [s for s in sites if s.kind == "attn_pattern"] if (
            positions is not None and not interventions and not self.handle.remote and any(positions)
            and attention_rows.supported(self.model)) else []
        call = self._bind("capture_batch", interventions, lengths=[len(seq) for seq in sequences],
                          batch_rows=len(sequences), capture=[s for s in sites if s not in pattern_sites])
        if self.handle.remote:  # an ndif: model: one nnsight trace over the batch (probes.ndif)
            return self._ndif_capture_batch(sequences, sites, call, prefix, positions, stop_after_last_site, vision)
        if prefix is not None:
            self._check_state(prefix)
        shared = len(prefix.ids) if prefix is not None else 0
        if prefix is not None and any(list(seq[:shared]) != prefix.ids for seq in sequences):
            raise BadInputError("every sequence must start with the prefix's tokens")
        if positions is not None:
            if len(positions) != len(sequences):
                raise BadInputError(f"positions has {len(positions)} lists for {len(sequences)} sequences")
            for seq, pos in zip(sequences, positions):
                bad = [p for p in pos if not (checks.is_integer(p) and shared <= p < len(seq))]
                if bad:
                    raise BadInputError(f"positions {bad[:5]} are outside {shared}..{len(seq) - 1} "
                                        "(after the prefix, inside the sequence)")
                if len(pos) > len(seq) - shared:  # repeats beyond a whole sequence's rows would multiply the output
                    raise BadInputError(f"{len(pos)} positions for a sequence of {len(seq) - shared} tokens after the "
                                        "prefix; ask for each position at most once")
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
        # a `logits` capture reads every position (as in `trace`); otherwise only the last is computed
        keep = 0 if any(site.kind == "logits" for site in sites) else 1
        kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=mask, logits_to_keep=keep,
                                      position_ids=torch.arange(shared, shared + width, device=dev).expand(len(sequences), -1))
        flat = kwargs["position_ids"]  # token positions (what installed interventions read)
        if prefix is not None:  # tails after an image of a 3-D-rotary model (Qwen-VL) sit at an offset
            kwargs["position_ids"] = flat + self._rope_offset(prefix.ids)
        if vision and "image_grid_thw" in vision:  # Qwen-VL: 3-D positions of the right-padded rows
            from probes.vision import mrope_positions

            kwargs["position_ids"] = mrope_positions(self.model, input_ids, mask, vision, self.handle.vision)
        kwargs.update({k: v for k, v in vision.items() if k != "mm_token_type_ids"})
        if prefix is not None:
            cache = _cache_view(prefix.cache, shared)
            if cache is None or cache.get_seq_length() != shared:
                raise BadInputError("this model's sliding-window cache cannot be shared by a batch; pass no prefix")
            cache.batch_repeat_interleave(len(sequences))
            kwargs.update(use_cache=True, **{self._cache_kw: cache})
        else:
            kwargs["use_cache"] = False
        deepest = max((s.layer for s in sites if s.layer is not None), default=None)
        stop_early = stop_after_last_site and deepest is not None and all(s.layer is not None for s in sites)
        rows, columns = None, sorted({p - shared for pos in (positions or []) for p in pos})
        if pattern_sites:
            deepest_pattern = max(s.layer for s in pattern_sites)
            # nothing wanted after the deepest pattern layer's attention: the forward ends inside it
            in_attention = stop_early and all(s.layer < deepest_pattern for s in sites if s not in pattern_sites)
            rows = attention_rows.AttentionRows(
                self.model, {s.layer: get_module(self.model, s.module_path(self.handle.family)) for s in pattern_sites},
                columns, stop=_stop_forward if in_attention else None)
            stop_early = stop_early and not in_attention
        # the rows path (no interventions, no prefix cache to write into) runs under inference mode: less
        # per-op autograd bookkeeping than no_grad (~0.3 ms of a 4 ms toy forward), the same numbers; every
        # tensor it returns is made below by torch.cat outside the block, so none is an inference tensor
        fast = torch.inference_mode() if rows is not None and prefix is None else contextlib.nullcontext()
        with self.lock, call, (rows or contextlib.nullcontext()), fast:
            runner = call.runner
            runner.ctx.batch, runner.ctx.seq, runner.ctx.phase = len(sequences), width, "trace"
            runner.ctx.positions = flat
            stopper = None
            if stop_early:
                last = get_module(self.model, Site("resid_post", deepest).module_path(self.handle.family))
                stopper = last.register_forward_hook(_stop_forward)  # after the runner's hooks: capture first
            try:
                cancel.check()  # a job's Stop ends it here (probes.cancel)
                self.model(**kwargs)
            except _EnoughLayers:
                pass
            finally:
                if stopper is not None:
                    stopper.remove()
            captured = dict(runner.captured)
        if positions is None:
            return captured
        picked = {name: torch.cat([v[b, [p - shared for p in pos]] for b, pos in enumerate(positions)])
                  for name, v in captured.items()}
        if rows is not None:  # [batch, heads, columns, keys] -> the chosen rows as [rows, heads, keys]
            at = {c: i for i, c in enumerate(columns)}
            # one index tensor per sequence for every site (a list index is made into a tensor at each use)
            index = [torch.tensor([at[p - shared] for p in pos], dtype=torch.long, device=dev) for pos in positions]
            for s in pattern_sites:
                r = rows.rows[s.layer]
                picked[s.name] = torch.cat([r[b].index_select(1, i).transpose(0, 1) for b, i in enumerate(index)])
        return {s.name: picked[s.name] for s in sites if s.name in picked}

    @torch.no_grad()
    def capture(self, text: Prompt, capture: Sequence[str], interventions: Sequence[Any] = (),
                chat: bool = False, images: Sequence[Any] | None = None) -> dict[str, torch.Tensor]:
        """One forward, the named sites out: {site: [seq, ...]}. `trace` without the statistics.

        >>> acts = Engine.from_id("tiny-random:llama").capture("hello world", ["resid_post.0"])
        >>> acts["resid_post.0"].shape
        torch.Size([2, 64])
        """
        ids = self.encode(text, chat=chat)
        (ids,), vision = self._vision_inputs([ids], None if images is None else [images])
        sites = self._check_sites(capture)
        call = self._bind("capture", interventions, lengths=[len(ids)], capture=sites)
        # the logits are not returned: compute the last position's only (a 4,096-token capture of a
        # 49k-vocabulary model would otherwise make 0.8 GB of logits and pay the unembedding per position)
        keep = 0 if any(site.kind == "logits" for site in sites) else 1
        return self._capture_forward(ids, sites, call, vision, logits_to_keep=keep)[0]

    def _vision_inputs(self, rows: list[list[int]], images: Any, n_samples: int = 1):
        """(rows with each `<image>` expanded into image tokens, pixel inputs), checked before model work."""
        from probes.vision import prepare

        if isinstance(images, (list, tuple)) and n_samples > 1:
            images = [im for im in images for _ in range(n_samples)]
        return prepare(self.handle.vision, self.handle.model_id, rows, images, self.handle.dtype, self.handle.device)

    def _capture_forward(self, ids: list[int], sites: list[Site], call: Call, vision: dict[str, Any] | None = None,
                         logits_to_keep: int = 0):
        """(activations {site: [seq, ...]}, logits [seq, vocab]) of one teacher-forced forward; with
        `call.rows` > 1 (row masks) the same ids run as that many batch rows: [rows, seq, ...] out.
        `logits_to_keep` > 0: the logits of that many last positions only (0: every position)."""
        if self.handle.remote:  # an ndif: model: one nnsight trace (probes.ndif)
            return self._remote_trace(ids, sites, call, logits_to_keep, vision)
        n_rows = call.rows
        input_ids = torch.tensor([ids] * n_rows, device=self.handle.device)
        if n_rows > 1 and vision:  # every row sees the same image(s)
            vision = {k: v.repeat(n_rows, *[1] * (v.ndim - 1)) if torch.is_tensor(v) else v for k, v in vision.items()}
        with self.lock, call:
            runner = call.runner
            runner.ctx.batch, runner.ctx.seq, runner.ctx.phase = n_rows, len(ids), "trace"
            runner.ctx.positions = torch.arange(len(ids), device=self.handle.device).expand(n_rows, -1)
            cancel.check()  # a job's Stop ends it here (probes.cancel)
            logits = self.model(input_ids=input_ids, use_cache=False, logits_to_keep=logits_to_keep,
                                **(vision or {})).logits
        if n_rows > 1:
            return dict(runner.captured), logits
        return {name: v[0] for name, v in runner.captured.items()}, logits[0]

    def _remote_trace(self, ids: list[int], sites: list[Site], call: Call, logits_to_keep: int = 0,
                      vision: dict[str, Any] | None = None):
        """A trace of an `ndif:` model: the same sites read (and edited) in one nnsight trace (probes.ndif);
        a capture that returns no logits reads none and stops after its deepest site."""
        from probes import ndif

        return ndif.trace_rows(self.handle, call, ids, sites, logits_to_keep, vision)

    def _ndif_capture_batch(self, sequences, sites, call, prefix, positions, stop_after_last_site, vision=None):
        from probes import ndif

        return ndif.capture_batch(self.handle, call, sequences, sites, prefix, positions, stop_after_last_site,
                                  self.tok.pad_token_id or 0, vision)

    def _ndif_generate(self, ids, sites, max_new_tokens, sampling, seed, call, top_k, stop, vision=None):
        from probes import ndif

        return ndif.generate(self, ids, sites, max_new_tokens, sampling, seed, call, top_k, stop, vision)

    def _local_only(self, what: str) -> None:
        if self.handle.remote:
            from probes.ndif import refused_call

            raise refused_call(self.handle, what)

    @torch.no_grad()
    def head_means(self, texts: Sequence[str], layer: int) -> torch.Tensor:
        """Mean per-head attention output `z.layer` over all positions of `texts` (for mean ablation)."""
        site = f"z.{layer}"
        rows = [self.trace(t, capture=[site]).activations[site] for t in texts]
        return torch.cat(rows).mean(0)

    # ----- KV-state forks -----

    @torch.no_grad()
    def prefill(self, prompt: Prompt, chat: bool = False, base: PrefixState | None = None,
                images: Sequence[Any] | None = None) -> PrefixState:
        """Run a prefix once and keep its KV cache for any number of `fork`s.

        With `base`, the tokens `prompt` shares with `base` are not recomputed (a live trace can be
        extended step by step at the cost of the new tokens only); `base` itself is left as it was.
        A vision-language model takes the prompt's `images` (one per `<image>`, probes.vision): the
        state's ids then hold the image tokens, and forks and extensions must start after them (a state
        keeps the image tokens' keys and values, not their pixels). Under 3-D rotary positions (Qwen-VL)
        the image's positions come from the model's `get_rope_index` and text after it sits at its index
        plus the image's offset (`probes.vision.mrope_offset`), as in Hugging Face's own decoding.
        """
        self._local_only("prefill")
        ids = self.encode(prompt, chat=chat)
        vision: dict[str, Any] = {}
        if images is not None:
            if base is not None:
                raise BadInputError("prefill with images starts a new state; extend it with base= and text only")
            (ids,), vision = self._vision_inputs([ids], [images])
        shared = 0
        if base is not None:
            self._check_state(base)
            shared = _common_prefix(ids, base.ids[:base.cache_len])
            if shared == len(ids):  # nothing new: keep one position to feed, the cache holds the rest
                shared -= 1
        cache = (_cache_view(base.cache, shared) if base is not None and shared > 0 else None) or self._new_cache()
        shared = cache.get_seq_length()
        if not vision:
            self._refuse_image_tokens(ids[shared:], "prefill")
        check_memory_of(self.handle, mode="prefill", lengths=[len(ids)], what="prefill()")
        t = torch.tensor([ids[shared:]], device=self.handle.device)
        mask = torch.ones(1, len(ids), dtype=torch.long, device=t.device)
        positions = torch.arange(shared, len(ids), device=t.device).view(1, -1) + self._rope_offset(ids[:shared])
        if vision and "image_grid_thw" in vision:  # Qwen-VL: the image's 3-D positions, from the model's own function
            from probes.vision import mrope_positions

            positions = mrope_positions(self.model, t, mask, vision, self.handle.vision)
            vision = {k: v for k, v in vision.items() if k != "mm_token_type_ids"}
        with self.lock:
            self._forward(t, mask, positions, cache, extra=vision)
        return PrefixState(ids, cache, self.handle.fingerprint)

    def _rope_offset(self, ids: Sequence[int]) -> int:
        """Where text after `ids` sits past its index under 3-D rotary positions (0 for other models)."""
        from probes.vision import mrope_offset

        return mrope_offset(self.model, self.handle.vision, ids)

    def _refuse_image_tokens(self, todo: Sequence[int], what: str) -> None:
        """Image tokens can only be computed with their pixels; a state keeps their cache entries only."""
        spec = self.handle.vision
        if spec is not None and spec.image_token_id in todo:
            raise BadInputError(f"{what} would recompute image tokens without their pixels: a prefix state keeps "
                                "the image tokens' cache entries, not the image. Start after the image (at= past its "
                                "last image token, or a base= state holding it), or prefill again with images=")

    @torch.no_grad()
    def fork(self, state: PrefixState, suffix: str | list[int], max_new_tokens: int = 16,
             capture: Sequence[str] = (), top_k: int = 5, stop: Sequence[str] = (),
             at: int | None = None, interventions: Sequence[Any] = ()) -> list[TokenRecord]:
        """Append `suffix` to a saved state (or to its first `at` tokens) and decode greedily.

        Costs the tokens not yet in the cache plus the suffix plus the decoded tokens, never the
        prefix. The state is read through a view of its cache, so it is never changed. `interventions`
        act on the positions the fork computes (steering edits: the prefix and suffix are its prompt).
        """
        self._check_state(state)
        if isinstance(suffix, str):
            if not suffix:
                raise BadInputError("fork needs a non-empty suffix")
            suffix_ids = self.encode(suffix, add_special_tokens=False)
        else:
            suffix_ids = self.encode(list(suffix)) if suffix else []
        at = len(state.ids) if at is None else at
        if not isinstance(at, int) or not 1 <= at <= len(state.ids):
            raise BadInputError(f"at={at!r}: fork from the first 1..{len(state.ids)} tokens of the state")
        _check_stop(stop)
        sites = self._check_sites(capture)
        if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise BadInputError(f"max_new_tokens must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, got {max_new_tokens}")
        prefix_ids = list(state.ids[:at])
        max_new_tokens = min(max_new_tokens, self.handle.arch.context_length - len(prefix_ids) - len(suffix_ids))
        if max_new_tokens < 1:
            raise BadInputError("the prefix and suffix already fill the model's context")
        cached = min(at, state.cache_len)
        if cached == at and not suffix_ids:
            cached -= 1  # the last token must be fed to predict the next one
        cache, dev = _cache_view(state.cache, cached) or self._new_cache(), self.handle.device
        cached = cache.get_seq_length()
        todo = prefix_ids[cached:] + list(suffix_ids)
        if not todo:
            raise BadInputError("fork needs a non-empty suffix")
        self._refuse_image_tokens(todo, "this fork")
        offset = self._rope_offset(prefix_ids[:cached])  # 3-D rotary positions after an image (Qwen-VL), else 0
        seq = prefix_ids + list(suffix_ids)
        step = _Step([seq], torch.ones(1, len(seq), dtype=torch.long, device=dev), None, [False], [""])
        records: list[TokenRecord] = []
        call = self._bind("fork", interventions, lengths=[len(seq)], batch_rows=1, capture=sites,
                          max_new_tokens=max_new_tokens)
        with self.lock, call:
            runner = call.runner
            runner.ctx.last_only, runner.ctx.phase = True, "decode"
            feed = torch.tensor([todo], device=dev)
            pos = torch.arange(cached, len(seq), device=dev).view(1, -1) + offset
            logits = self._forward(feed, step.mask, pos, cache)
            for t in range(max_new_tokens):
                next_ids, recs = self._step_records(logits, Sampling(), None, top_k, step, t, runner, [])
                rec = recs[0]
                seq.append(rec.token_id)
                step.texts[0] += rec.text
                rec.finished = (t == max_new_tokens - 1 or rec.token_id in self._eos
                                or any(s in step.texts[0] for s in stop))
                records.append(rec)
                if rec.finished:
                    break
                step.mask = torch.ones(1, len(seq), dtype=torch.long, device=dev)
                logits = self._forward(next_ids.view(1, 1), step.mask, torch.tensor([[len(seq) - 1 + offset]], device=dev),
                                       cache)
        return records

    def free(self, state: PrefixState) -> None:
        """Drop a state's cache (its memory is released once nothing else holds it)."""
        state.cache = None

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, PrefixState):
            raise BadInputError(f"{type(state).__name__} is not a prefix state of this engine; make one with prefill()")
        if state.fingerprint and state.fingerprint != self.handle.fingerprint:
            raise BadInputError(f"prefix state {state.id} was made by another model ({state.fingerprint}); "
                                f"this engine runs {self.handle.model_id} ({self.handle.fingerprint})")
        state.cache_len  # raises when freed
        if not getattr(state.cache, "forkable", True):
            raise BadInputError("this state holds a compressed KV cache (a KV-cache policy dropped entries); forks "
                                "need the full cache: prefill the same tokens without a policy")

    # ----- gradient fits -----

    def minimize_entropy(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], site: str,
                         basis: torch.Tensor, *, iterations: int = 30, lr: float = 0.01, batch_size: int = 8,
                         seed: int = 0, on_step: Any = None) -> Any:
        """Coefficients over `basis` rows that minimise next-token entropy on generated tokens when
        their combination is added at `site` (RISE confidence vectors; see `probes.optimize`)."""
        from probes.optimize import minimize_entropy

        self._local_only("minimize_entropy")
        sequences = [self.encode(list(seq)) for seq in sequences]
        with self.lock:
            return minimize_entropy(self.handle, sequences, starts, site, basis, iterations=iterations, lr=lr,
                                    batch_size=batch_size, seed=seed, pad_id=self.tok.pad_token_id or 0,
                                    on_step=on_step)

    # ----- readouts -----

    @torch.no_grad()
    def readout(self, vectors: torch.Tensor, *, norm: bool = True, top_k: int = 10, bottom_k: int = 0,
                token_ids: Sequence[int] | None = None) -> Readout:
        """Decode residual-stream vectors [n, d_model] through the model's own unembedding.

        `norm=True` applies the final norm first (the logit lens); `norm=False` reads a direction
        as written into the residual stream (an SAE decoder row, a steering vector). Returns the
        `top_k` (and `bottom_k`) tokens per row with their logits and probabilities and, for
        `token_ids` (one per row), that token's probability and rank.
        """
        x = torch.as_tensor(vectors)
        if x.ndim == 1:
            x = x.view(1, -1)
        d = self.handle.arch.d_model
        if x.ndim != 2 or x.shape[1] != d or x.shape[0] < 1:
            raise BadInputError(f"readout takes vectors of shape [n, {d}] (d_model); got {tuple(x.shape)}")
        if x.shape[0] > MAX_READOUT_ROWS:
            raise BadInputError(f"readout takes at most {MAX_READOUT_ROWS} vectors per call; got {x.shape[0]}")
        if not torch.isfinite(x).all():
            raise BadInputError("the vectors to read out contain NaN or infinite values")
        vocab = self.handle.arch.vocab_size
        if not isinstance(top_k, int) or not isinstance(bottom_k, int) or not 0 <= top_k <= 100 or not 0 <= bottom_k <= 100:
            raise BadInputError("top_k and bottom_k must be integers in 0..100")
        if max(top_k, bottom_k) > vocab:
            raise BadInputError(f"top_k and bottom_k can be at most the vocabulary size, {vocab}")
        if token_ids is not None:
            token_ids = [int(t) for t in token_ids]
            if len(token_ids) != x.shape[0] or any(not 0 <= t < vocab for t in token_ids):
                raise BadInputError(f"token_ids needs one id in 0..{vocab - 1} per vector ({x.shape[0]})")
        head = self.model.get_output_embeddings()
        final_norm = get_module(self.model, FAMILIES[self.handle.family]["final_norm"]) if norm else None
        out = {k: [] for k in ("top_ids", "top_logits", "top_probs", "bottom_ids", "bottom_logits", "token_probs",
                               "token_ranks")}
        shipped = None
        if self.handle.remote:  # an ndif: model: the norm and unembedding run in one nnsight trace (probes.ndif)
            from probes.ndif import readout_rows

            shipped = readout_rows(self.handle, x.to(self.handle.dtype), norm).float()
        # A readout only reads two modules' weights, so it runs beside a generation instead of waiting for the
        # model lock (a RISE page's feature words waited out a whole steering job, 8 s, in every new tab): the
        # modules' own class forwards, called directly, run neither the hooks nor the replaced instance forwards
        # another call may have installed on them. Weights an offload hook keeps on the meta device until a
        # forward still go through the modules, under the lock.
        direct = shipped is None and not any(p.is_meta for m in (head, final_norm) if m is not None
                                             for p in m.parameters())
        with contextlib.nullcontext() if direct or shipped is not None else self.lock:
            for lo in range(0, x.shape[0], 256):
                if shipped is not None:
                    logits = shipped[lo:lo + 256]
                else:
                    rows = x[lo:lo + 256].to(head.weight.device, head.weight.dtype)
                    if direct:
                        if final_norm is not None:  # on its own device (a sharded model's norm and head may differ)
                            on = next(final_norm.parameters(), head.weight).device
                            rows = type(final_norm).forward(final_norm, rows.to(on)).to(head.weight.device)
                        logits = type(head).forward(head, rows).float()
                    else:
                        if final_norm is not None:
                            rows = final_norm(rows)
                        logits = head(rows).float()
                probs = logits.softmax(-1)
                tv, ti = logits.topk(top_k, dim=-1)
                out["top_ids"].append(ti.cpu())
                out["top_logits"].append(tv.cpu())
                out["top_probs"].append(probs.gather(-1, ti).cpu())
                bv, bi = (-logits).topk(bottom_k, dim=-1)
                out["bottom_ids"].append(bi.cpu())
                out["bottom_logits"].append((-bv).cpu())
                if token_ids is not None:
                    tid = torch.tensor(token_ids[lo:lo + 256], device=logits.device).view(-1, 1)
                    chosen = logits.gather(-1, tid)
                    out["token_probs"].append(probs.gather(-1, tid).view(-1).cpu())
                    out["token_ranks"].append((logits > chosen).sum(-1).cpu())
        cat = {k: torch.cat(v) if v else None for k, v in out.items()}
        return Readout(**cat)

    # ----- plumbing -----

    def _new_cache(self) -> Any:
        """A transformers cache whose full-attention layers grow in place (probes.kv_growth says why; a KV
        policy brings its own cache through the call: `Call.new_cache`)."""
        from transformers import DynamicCache

        from probes.kv_growth import growing

        return growing(DynamicCache(config=self.model.config))

    def _forward(self, input_ids, mask, positions, cache, extra: dict[str, Any] | None = None) -> torch.Tensor:
        cancel.check()  # each decoding step, prefill and fork: a job's Stop ends the work here (probes.cancel)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache}, **(extra or {}))
        return out.logits[:, -1]

    def _left_pad(self, ids: list[list[int]]):
        """Left-pad a batch; return ids and attention mask."""
        width = max(map(len, ids))
        pad = self.tok.pad_token_id
        dev = self.handle.device
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long, device=dev)
        mask = torch.zeros((len(ids), width), dtype=torch.long, device=dev)
        for b, row in enumerate(ids):
            input_ids[b, width - len(row):] = torch.tensor(row, device=dev)
            mask[b, width - len(row):] = 1
        return input_ids, mask

    # ----- slots: gradients, head gates -----

    def input_x_gradient(self, text: Prompt, *, target: str = "logprob", positions: Sequence[int] | None = None,
                         token: int | None = None, foil: int | None = None, sites: Sequence[str] = (),
                         interventions: Sequence[Any] = (), chat: bool = False,
                         images: Sequence[Any] | None = None) -> Any:
        """Input x gradient of one output (see `probes.gradients`): per-token scores [seq], F(x), F(0),
        and activation x gradient at residual `sites`. Interventions (steering, MaskAttention) apply.
        With `images` (a VLM) read the image tokens' scores at `resid_pre.0`.

        >>> att = Engine.from_id("tiny-random:llama").input_x_gradient("a b c", target="logit", token=5)
        >>> att.positions, att.scores.shape
        ([3], torch.Size([3]))
        """
        from probes.gradients import check_sites, check_target, input_x_gradient

        self._local_only("input_x_gradient")
        ids = self.encode(text, chat=chat)
        (ids,), vision = self._vision_inputs([ids], None if images is None else [images])
        site_list = self._check_sites(sites)
        check_sites(site_list)
        positions = check_target(target, len(ids), self.handle.arch.vocab_size, positions, token, foil)
        if vision and "image_grid_thw" in vision:  # Qwen2-VL from input embeddings: give it its 3-D positions
            from probes.vision import mrope_positions

            row = torch.tensor([ids], device=self.handle.device)
            vision = {**vision, "position_ids": mrope_positions(self.model, row, torch.ones_like(row), vision,
                                                                self.handle.vision)}
        call = self._bind("gradient", interventions, lengths=[len(ids)], batch_rows=1)
        with self.lock, call:
            runner = call.runner
            runner.ctx.batch, runner.ctx.seq, runner.ctx.phase = 1, len(ids), "trace"
            runner.ctx.positions = torch.arange(len(ids), device=self.handle.device).view(1, -1)
            return input_x_gradient(self.handle, ids, target=target, positions=positions, token=token, foil=foil,
                                    sites=site_list, model_inputs=vision)

    # ----- RLKV head gates (issue 13; probes.gates): in-process only, the model stays frozen -----

    def head_gates(self, sink: int = 128, recent: int = 256, init: float = 1.0, gates: Any = None) -> Any:
        """A `probes.gates.GateSession`: inside `with engine.head_gates(...) as s:` every KV head attends
        alpha * full + (1 - alpha) * local (first `sink` + last `recent` positions); `s.alpha` [layers, kv_heads]
        is the trainable gate (starting at `init`, or `gates`), `s.generate` samples, `s.logprobs` gives
        gradients. Checks run here, before any model work."""
        from probes.gates import GateSession

        self._local_only("head gates")
        return GateSession(self, sink=sink, recent=recent, init=init, gates=gates)



def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _cache_view(cache: Any, length: int) -> Any | None:
    """A cache holding the first `length` positions of `cache` that can grow without changing it.

    Cache layers grow by concatenation into new tensors, or in place only into a buffer the layer object
    made itself (probes.kv_growth: a copy of a layer starts its own), so a shallow copy whose layers hold
    slices of the original tensors is enough: `cache` never sees what the view appends. A
    sliding-window layer may already have dropped old positions and cannot be cut back: then the
    view is a deep copy when `length` is the whole cache, and None otherwise (recompute).
    """
    layers = getattr(cache, "layers", [])
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return copy.deepcopy(cache) if length >= cache.get_seq_length() else None
    view = copy.copy(cache)
    view.layers = [copy.copy(layer) for layer in layers]
    for layer in view.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
    return view


class _EnoughLayers(Exception):
    """Raised by a hook to end a forward once the deepest wanted layer has run."""


def _stop_forward(*_: Any) -> None:
    raise _EnoughLayers

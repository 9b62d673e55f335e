"""What every page receives: the `PageContext` the shared sidebar builds (backend, model, prompt, settings).

A page reads the model only through `ctx.backend` (in-process engine or HTTP client alike) and
keys its caches with `ctx.cache_key()`, so two pages asked the same thing share one result.

The long-prompt guard lives here, in `model_input()`, so every page meets it before any model work:
a prompt over `prompt_warn_tokens` tokens (the sidebar's "Warn above", default from the environment
variable THOUGHTSCOPE_PROMPT_WARN_TOKENS, else 2,000), or one whose generation would run past the
model's context, raises a `LongPromptError` with the estimate (tokens, and seconds from this backend's
measured speed when a generation has been timed) until the sidebar's "Run with this long prompt" is
ticked. A prompt over the model's context, or over MAX_PROMPT_CHARS (200,000) characters, is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from probes.backend import Backend
from probes.engine import Sampling
from probes.tokens import MAX_PROMPT_CHARS
from thoughtscope import checks
from thoughtscope.errors import BadInputError, ThoughtscopeError

ChatMessages = list[dict[str, str]]

PROMPT_WARN_ENV = "THOUGHTSCOPE_PROMPT_WARN_TOKENS"
PROMPT_WARN_TOKENS = 2000  # the default: a prompt longer than this needs a confirmation
CONFIRM_LABEL = "Run with this long prompt"
# Tokens a chat template may add around the messages (system prompt, role markers): a prompt whose
# UTF-8 bytes plus this stay under every limit is surely under them (a token covers at least one byte),
# so it is never tokenized just to be checked.
TEMPLATE_ALLOWANCE = 256


def prompt_warn_default() -> int:
    """THOUGHTSCOPE_PROMPT_WARN_TOKENS when set to a positive whole number, else PROMPT_WARN_TOKENS."""
    raw = os.environ.get(PROMPT_WARN_ENV, "").strip()
    try:
        value = int(raw) if raw else PROMPT_WARN_TOKENS
    except ValueError:
        value = PROMPT_WARN_TOKENS  # a mistyped variable: the default stands (the sidebar shows which)
    return value if value > 0 else PROMPT_WARN_TOKENS


class LongPromptError(BadInputError):
    """A prompt long enough to need the user's confirmation before any model work (`estimate` says why)."""

    def __init__(self, estimate: "PromptEstimate"):
        super().__init__(estimate.message())
        self.estimate = estimate

    def __reduce__(self) -> Any:  # a copy (pickled, e.g. from a job's worker) keeps the estimate
        return type(self), (self.estimate,)


@dataclass(frozen=True)
class GenerationSpeed:
    """What one timed generation of a backend showed: prompt tokens per second until the first new token
    (prefill, with the call's own overhead) and new tokens per second after it."""

    prefill_tps: float
    decode_tps: float | None

    def seconds(self, prompt_tokens: int, new_tokens: int) -> float:
        """A rough, linear estimate (attention's cost grows faster than linearly with a long prompt)."""
        decode = new_tokens / self.decode_tps if self.decode_tps else 0.0
        return prompt_tokens / self.prefill_tps + decode


_speeds: dict[tuple[str | None, str], GenerationSpeed] = {}  # (server, model) -> the latest timed generation
_speeds_lock = threading.Lock()


def measured_speed(server_url: str | None, model_id: str) -> GenerationSpeed | None:
    with _speeds_lock:
        return _speeds.get((server_url, model_id))


def record_speed(server_url: str | None, model_id: str, speed: GenerationSpeed) -> None:
    with _speeds_lock:
        _speeds[(server_url, model_id)] = speed


@dataclass(frozen=True)
class PromptEstimate:
    """How long a prompt is, against the limits it crossed, and what it would roughly cost."""

    n_chars: int
    n_tokens: int
    warn_tokens: int
    context_length: int | None
    max_new_tokens: int
    seconds: float | None  # None: no generation on this backend timed yet

    @property
    def over_warning(self) -> bool:
        return self.n_tokens > self.warn_tokens

    @property
    def past_context(self) -> bool:
        return self.context_length is not None and self.n_tokens + self.max_new_tokens > self.context_length

    @property
    def needs_confirmation(self) -> bool:
        return self.over_warning or self.past_context

    def message(self) -> str:
        why = []
        if self.over_warning:
            why.append(f"over the {self.warn_tokens:,}-token warning limit (the sidebar's \"Warn above\", "
                       f"default from {PROMPT_WARN_ENV})")
        if self.past_context:
            why.append(f"with {self.max_new_tokens} new tokens it runs past the model's context of "
                       f"{self.context_length:,} tokens")
        cost = (f"about {self.seconds:,.0f} s on this backend (a rough estimate from its last timed generation)"
                if self.seconds is not None else "unknown (no generation on this backend has been timed yet)")
        return (f"This prompt is long: {self.n_tokens:,} tokens ({self.n_chars:,} characters), {'; '.join(why)}. "
                f"Time for one generation: {cost}. Tick \"{CONFIRM_LABEL}\" in the sidebar to run it, or "
                "shorten it.")


def _input_bytes(model_input: str | ChatMessages) -> int:
    if isinstance(model_input, str):
        return len(model_input.encode("utf-8"))
    return sum(len(m.get("content", "").encode("utf-8")) for m in model_input)


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings from the sidebar; `top_alternatives` is how many rivals a record keeps."""

    max_new_tokens: int = 48
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    top_alternatives: int = 5

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PageContext:
    """The sidebar's choices. `prompt` is what the user typed; `model_input()` is what the model gets."""

    backend: Backend
    model_id: str
    prompt: str
    chat: bool = True
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    seed: int = 0
    server_url: str | None = None
    one_shot: bool = True  # chat mode: prepend the worked example that helps the embedded model
    prompt_warn_tokens: int = field(default_factory=prompt_warn_default)
    long_prompt_confirmed: bool = False  # the sidebar's "Run with this long prompt"
    prompt_box: str = "the sidebar"  # where the prompt was typed (a page with its own box says so in errors)
    _estimate: Any = field(default=None, init=False, repr=False, compare=False)
    _context_length: Any = field(default=-1, init=False, repr=False, compare=False)

    def model_input(self) -> str | ChatMessages:
        """Raw text, or chat messages (with the one-shot worked example when asked for).

        Raises `LongPromptError` for a long prompt the user has not confirmed (see the module's docstring)."""
        model_input = self._unchecked_input()
        estimate = self.prompt_estimate()
        if estimate is not None and not self.long_prompt_confirmed:
            raise LongPromptError(estimate)
        return model_input

    def _unchecked_input(self) -> str | ChatMessages:
        if not self.prompt.strip():
            raise BadInputError(f"the prompt is empty; type a question in {self.prompt_box} (or reload for the example)")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise BadInputError(f"the prompt has {len(self.prompt):,} characters; the workbench takes at most "
                                f"{MAX_PROMPT_CHARS:,} (probes.tokens.MAX_PROMPT_CHARS): shorten it")
        if not self.chat:
            return self.prompt
        if self.one_shot:
            from analyses.tasks import one_shot_messages

            return one_shot_messages(self.prompt)
        return [{"role": "user", "content": self.prompt}]

    def prompt_estimate(self) -> PromptEstimate | None:
        """The prompt's length and rough cost when it needs a confirmation, else None (a prompt surely under
        every limit is not even tokenized).

        Tokenizing is no model work (through a server, the tokenizer runs here). A prompt over the model's
        context raises the engine's own `BadInputError`, which names its length: it cannot run at all."""
        model_input = self._unchecked_input()
        max_new = self.settings.max_new_tokens
        asked = (json.dumps(model_input), self.prompt_warn_tokens, max_new)
        if self._estimate is not None and self._estimate[0] == asked:  # model_input() runs often in one page
            return self._estimate[1]
        # arch() once per context (a client reads it once from the server's /info)
        context = self._context_length = (self._context_length if self._context_length != -1
                                          else self.backend.arch().context_length)
        limit = min(self.prompt_warn_tokens, (context - max_new) if context else self.prompt_warn_tokens)
        estimate = None
        if _input_bytes(model_input) + TEMPLATE_ALLOWANCE > limit:
            n_tokens = len(self.backend.encode(model_input, chat=False))
            speed = measured_speed(self.server_url, self.model_id)
            estimate = PromptEstimate(
                n_chars=len(self.prompt), n_tokens=n_tokens, warn_tokens=self.prompt_warn_tokens,
                context_length=context, max_new_tokens=max_new,
                seconds=None if speed is None else speed.seconds(n_tokens, max_new))
            if not estimate.needs_confirmation:
                estimate = None
        self._estimate = (asked, estimate)
        return estimate

    def result_key(self, kind: str, **parts: Any) -> str:
        """A string naming a page's result by its kind, the model behind it and `parts` (not the prompt)."""
        return json.dumps({"kind": kind, "server": self.server_url, "model": self.model_id, **parts},
                          sort_keys=True, default=str)

    def cache_key(self, **extra: Any) -> str:
        """A string naming everything a generation depends on (plus `extra`), for st.cache_data keys."""
        return json.dumps({
            "server": self.server_url, "model": self.model_id, "input": self.model_input(),
            "settings": self.settings.to_dict(), "seed": self.seed, **extra,
        }, sort_keys=True)

    def provenance(self, *, interventions: Sequence[Any] = (), settings: dict[str, Any] | None = None,
                   data: str | None = None, split: str | None = None, prompt: Any = "sidebar",
                   **extra: Any) -> dict[str, Any]:
        """The provenance record of a result made on this page (`thoughtscope.provenance`): model and
        fingerprint, the model input (or `prompt`), seed, generation settings plus `settings`,
        interventions, data set and split."""
        from thoughtscope.provenance import provenance

        if prompt == "sidebar":
            try:
                prompt = self.model_input()
            except BadInputError:
                prompt = self.prompt
        return provenance(
            self.backend.info(), prompt=prompt, data=data, split=split, seed=self.seed,
            settings={"generation": self.settings.to_dict(), "chat": self.chat, "one_shot": self.one_shot,
                      **(settings or {})},
            interventions=interventions, command="thoughtscope app",
            backend=f"server {self.server_url}" if self.server_url else "in-process", **extra)

    def generate(self, **kwargs: Any):
        """Stream token records for the current prompt and settings (see `Engine.generate`); the stream is
        timed, so the long-prompt guard can estimate the next prompt's seconds on this backend."""
        s = self.settings
        model_input = self.model_input()
        stream = self.backend.generate(model_input, max_new_tokens=s.max_new_tokens, sampling=s.sampling(),
                                       seed=self.seed, top_k=s.top_alternatives, **kwargs)
        return _TimedStream(stream, lambda: len(self.backend.encode(model_input, chat=False)),
                            (self.server_url, self.model_id))


class _TimedStream:
    """A generation's records as they come (the stream's own methods pass through), timed on the way:
    at its end the backend's measured speed is updated."""

    def __init__(self, stream: Any, prompt_tokens: Any, where: tuple[str | None, str]):
        self._stream, self._prompt_tokens, self._where = stream, prompt_tokens, where
        self._start, self._first, self._last, self._n = time.perf_counter(), None, None, 0

    def __iter__(self) -> "_TimedStream":
        return self

    def __next__(self) -> Any:
        try:
            rec = next(self._stream)
        except StopIteration:
            self._record()
            raise
        now = time.perf_counter()
        self._first = now if self._first is None else self._first
        self._last, self._n = now, self._n + 1
        return rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _record(self) -> None:
        if self._first is None:
            return
        try:
            n_prompt = int(self._prompt_tokens())
        except ThoughtscopeError:
            return
        decode_s = self._last - self._first
        speed = GenerationSpeed(prefill_tps=n_prompt / max(self._first - self._start, 1e-6),
                                decode_tps=(self._n - 1) / decode_s if self._n > 1 and decode_s > 0 else None)
        record_speed(*self._where, speed)


class FinishedGenerations:
    """Finished streamed generations, shared by every session of this process (newest 32 kept).

    A streamed generation draws while it runs, which `st.cache_data` cannot replay, so the records
    are kept here once complete: reopening a page with the same prompt and settings shows them at once.
    """

    def __init__(self, max_entries: int = 32):
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries

    def get(self, key: str) -> list[dict[str, Any]] | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key: str, records: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[key] = records
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)


@dataclass
class ErrorSpot:
    """What `shows_errors` caught (None when the block ran through)."""

    error: ThoughtscopeError | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@contextlib.contextmanager
def shows_errors(where: Any = None) -> Iterator[ErrorSpot]:
    """Show a user's mistake (a `ThoughtscopeError`) raised in the block right here, as an st.error in
    `where` (default: the current container), instead of in place of the whole page: the controls
    drawn before stay, and the page goes on below.

        with shows_errors() as spot:
            records = generate(ctx)
        if spot.failed:
            return
    """
    import streamlit as st

    from app import outage

    spot = ErrorSpot()
    try:
        yield spot
    except ThoughtscopeError as err:
        spot.error = err
        outage.note_error(err)  # a model server that stopped answering is also said at the top of the page
        (where if where is not None else st).error(str(err), icon=":material/error:")


def compute(key: str, work: Callable[[], Any], *, start: bool, spinner: str | None = "Computing\u2026",
            again: bool = False, kind: str = "", page: str = "") -> Any:
    """The "button, compute, keep" block of short work (a few seconds; longer work is a job, `app.jobs.run_job`):
    the finished result for `key` when one is kept; else, when `start` (the page's button was pressed), `work()`
    run here under a spinner, kept by `key` and returned. `again` runs it even when a result is kept (a
    streamed generation that draws while it runs: `spinner=None`). A user's mistake raised by `work` (a
    `ThoughtscopeError`: `BadInputError` and friends) is shown right here as st.error, never as a traceback,
    and gives None. Results are kept where jobs keep theirs (`app.jobs.registry()`, by key), so a page reads
    every finished result the same way, and reopening it with the same settings shows the result at once.

        run = st.button("Compute", key="lens_run")
        lens = compute(ctx.result_key("lens", layer=layer), lambda: logit_lens(ctx.backend, text, layer),
                       start=run, spinner="Reading the lens\u2026")
        if lens is None:
            st.info("Press **Compute** for the lens at this layer.")
            return
        show_figure(lens_figure(lens), lens.to_dict(), "logit_lens")
    """
    import streamlit as st

    from app import jobs

    registry = jobs.registry()
    if not again:
        kept = registry.finished(key)
        if kept is not None:
            return kept
    if not start:
        return None
    with shows_errors() as spot, (st.spinner(spinner) if spinner else contextlib.nullcontext()):
        result = work()
    if spot.failed:
        return None
    registry.keep(key, result, kind=kind, label=spinner or kind, page=page)
    return result


def read_report(path: str | Path, what: str, needs: dict[str, type], command: str) -> dict[str, Any] | None:
    """An evaluation report the user named: a JSON object whose fields `needs` ({name: type}) are there with
    those types, else a `BadInputError` naming what is missing and the command that writes one. `{}` and `null`
    are refused too (they drew nothing, silently)."""
    data = read_json(path)
    wrong = [name for name, kind in needs.items() if not isinstance(data, dict) or not isinstance(data.get(name), kind)]
    if wrong:
        got = "a JSON " + type(data).__name__.replace("dict", "object").replace("NoneType", "null") \
            if not isinstance(data, dict) else f"an object without {', '.join(repr(w) for w in wrong)} as a report has them"
        raise BadInputError(f"{path} is not {what}: {got}; make one with `{command}`")
    return data


@contextlib.contextmanager
def drawing_report(path: str | Path, what: str) -> Iterator[None]:
    """Inside `shows_errors`: a report from a user's file whose inner fields have other shapes than the figure
    reads (a hand-edited or truncated file) is said as a `BadInputError`, not a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        field = f"the field {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {str(err)[:120]}"
        raise BadInputError(f"{path} does not hold {what} the page can draw ({field}); is it the unedited JSON "
                            "the command wrote?") from err


def read_json(path: str | Path) -> Any:
    """A JSON file the user named (an evaluation report): its content, or a `BadInputError` saying why not."""
    file = checks.user_path("JSON file", path)
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as err:  # not JSON, not UTF-8, or nested past Python's stack
        raise BadInputError(f"cannot read {path}: {err}") from err

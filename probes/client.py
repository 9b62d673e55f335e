"""`RemoteBackend`: the Backend protocol over HTTP, talking to `thoughtscope serve`.

A page or an analysis takes a `Backend` and cannot tell this from the in-process `Engine`:
`generate` yields the same `TokenRecord`s (activations decoded from safetensors to tensors) as
the server makes them, `trace` returns the same `Trace`, prefix states are `RemotePrefix` handles
naming states the server holds. Tokenizer operations run here, on the tokenizer files the server
hands out once (the same `TokenizerOps` the engine uses). Error responses become the project's
errors with the server's message; a full queue is a `ServerBusyError` with `retry_after` (and
`queue_ticket`: the next request of this backend sends it back, so a client that retries keeps its
place in the server's line).

Example:
    >>> from probes.client import RemoteBackend
    >>> backend = RemoteBackend("http://127.0.0.1:8765", token=None)  # doctest: +SKIP
    >>> for rec in backend.generate("2 + 2 =", max_new_tokens=4):  # doctest: +SKIP
    ...     print(rec.text, rec.entropy)
"""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from probes import cancel
from probes.arch import ArchInfo
from probes.optimize import EntropyFit
from probes.records import Readout, TokenRecord, Trace
from probes.tokens import TokenizerOps, tokenizer_from_files
from probes.wire import (
    QUEUE_TICKET_HEADER,
    SERVER_INFO_KEYS,
    ServerBusyError,
    ServerError,
    b64_to_tensors,
    error_from_body,
    intervention_to_spec,
    parse_sse,
    record_from_json,
    sampling_to_spec,
    tensors_to_b64,
    trace_from_json,
)
from thoughtscope.errors import BadInputError, ThoughtscopeError


@dataclass
class RemotePrefix:
    """A prefix state the model server holds: its id, its tokens, the model that made it."""

    id: str
    ids: list[int]
    fingerprint: str
    n_bytes: int = 0
    url: str = field(default="", repr=False)


def _checked(lines: Iterator[str]) -> Iterator[str]:
    """The stream's lines, with this thread's cancel check (probes.cancel) before each: a stopped job's stream
    ends before its next record (`RemoteStream._run` closes the response, and the server frees the model at its
    next token), and one that waits in the server's queue at the next keep-alive, not when its first token
    comes."""
    for line in lines:
        cancel.check()
        yield line


class RemoteStream(Iterator[TokenRecord]):
    """The records of one remote generation as they arrive; `cancel()` stops it at the next token."""

    def __init__(self, backend: "RemoteBackend", request_id: str, body: dict[str, Any]):
        self.backend, self.request_id = backend, request_id
        self.records: list[TokenRecord] = []
        self.cancelled = False
        # Opened here, as `Engine.generate` checks its inputs here: a bad request raises at the call.
        self._exit = ExitStack()
        response = self._exit.enter_context(backend._open_stream(body))
        self._events = self._run(response)

    def _run(self, response: httpx.Response) -> Iterator[TokenRecord]:
        try:
            for event, data in parse_sse(_checked(response.iter_lines())):
                if event == "token":
                    yield record_from_json(data)
                elif event == "error":
                    raise error_from_body(data.get("status", 500), data)
                elif event == "end":
                    self.cancelled = bool(data.get("cancelled"))
                    return
        except httpx.HTTPError as err:
            raise self.backend._unreachable(err) from err
        finally:
            self._exit.close()
        raise ServerError("the model server closed the stream before its end event; check the server log")

    def __next__(self) -> TokenRecord:
        rec = next(self._events)  # a job's Stop ends it at the stream's next line (`_checked`)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        """Stop reading; the server notices the closed connection and frees the model at the next token."""
        self._events.close()
        self._exit.close()

    def __del__(self) -> None:  # an abandoned stream must not keep its connection (and the model) busy
        if hasattr(self, "_exit"):
            self._exit.close()

    def cancel(self) -> bool:
        return self.backend.cancel(self.request_id)

    def text(self, batch_index: int = 0) -> str:
        return "".join(r.text for r in self.records if r.batch_index == batch_index)


class RemoteBackend:
    """The model behind `thoughtscope serve` at `url`, as a `Backend`.

    `timeout` bounds connecting and each read (a token, or the wait for a place on a busy model:
    a queued stream sends a keep-alive every few seconds, so a long queue does not trip it).
    """

    def __init__(self, url: str = "http://127.0.0.1:8765", token: str | None = None, timeout: float = 60.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout))
        self._ops: TokenizerOps | None = None
        self._ops_lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self._arch: ArchInfo | None = None
        self.server_info: dict[str, Any] = {}  # what GET /info says of the server itself (its request budget)
        self._queue_ticket: str | None = None  # our place in line after a 503, sent with the next request

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RemoteBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- the Backend protocol -----

    def info(self) -> dict[str, Any]:
        """`Engine.info()` of the served model; the server's own sections go to `server_info`."""
        body = self._call("GET", "/info")
        self.server_info = {key: body.pop(key) for key in SERVER_INFO_KEYS if key in body}
        self._info = body
        return self._info

    def arch(self) -> ArchInfo:
        """The served model's `ArchInfo`, rebuilt from /info's "arch" section (read once: it cannot change)."""
        if self._arch is None:
            self._arch = ArchInfo.from_dict((self._info or self.info())["arch"])
        return self._arch

    def sites(self) -> list[dict[str, Any]]:
        return self._call("GET", "/sites")

    def capabilities(self) -> dict[str, bool]:
        # head gates train on the model's own weights in the process that holds it: never through a server
        return {**self._call("GET", "/capabilities"), "head_gates": False}

    # ----- tokens: encoded here, with the server's tokenizer (fetched once) -----

    @property
    def ops(self) -> TokenizerOps:
        with self._ops_lock:
            if self._ops is None:
                body = self._call("GET", "/tokenizer")
                files = {name: base64.b64decode(data) for name, data in body["files"].items()}
                self._ops = TokenizerOps(tokenizer_from_files(files), body["context_length"], body["vocab_size"],
                                         body["eos_ids"])
            return self._ops

    def encode(self, prompt: Any, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        return self.ops.encode(prompt, chat=chat, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.ops.decode(ids, skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return self.ops.token_texts(ids)

    def eos_ids(self) -> list[int]:
        return self.ops.eos_ids()

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.ops.render_chat(messages, add_generation_prompt)

    def ready(self) -> dict[str, Any]:
        """Readiness and limits (busy, waiting, max_queue, max_new_tokens_cap); raises while loading."""
        return self._call("GET", "/ready")

    def generate(self, prompt: Any = None, *, prompts: Sequence[Any] | None = None, n_samples: int = 1,
                 max_new_tokens: int = 64, sampling: Any = None, seed: int = 0, capture: Sequence[str] = (),
                 interventions: Sequence[Any] = (), top_k: int = 5, stop: Sequence[str] = (),
                 chat: bool = False, request_id: str | None = None, images: Any = None) -> RemoteStream:
        """Stream one record per new token (see `Engine.generate`). The request starts on the first `next`.
        `images` (a VLM) travel as base64 PNG, never as paths."""
        request_id = request_id or uuid.uuid4().hex
        body: dict[str, Any] = {
            "prompt": prompt, "prompts": None if prompts is None else list(prompts), "n_samples": n_samples,
            "max_new_tokens": max_new_tokens, "seed": seed, "capture": list(capture),
            "interventions": [intervention_to_spec(iv) for iv in interventions], "top_k": top_k,
            "stop": list(stop), "chat": chat, "request_id": request_id,
        }
        if sampling is not None:
            body["sampling"] = sampling_to_spec(sampling)
        if images is not None:
            body["images"] = _images_to_wire([images] if prompts is None else images)
        return RemoteStream(self, request_id, body)

    def trace(self, text: Any, capture: Sequence[str] = (), interventions: Sequence[Any] = (),
              chat: bool = False, images: Sequence[Any] | None = None) -> Trace:
        body = {"text": text, "capture": list(capture),
                "interventions": [intervention_to_spec(iv) for iv in interventions], "chat": chat}
        if images is not None:
            body["images"] = _images_to_wire([images])[0]
        return trace_from_json(self._call("POST", "/trace", json=body))

    def capture(self, text: Any, capture: Sequence[str], interventions: Sequence[Any] = (),
                chat: bool = False, images: Sequence[Any] | None = None) -> dict[str, torch.Tensor]:
        return self.trace(text, capture=capture, interventions=interventions, chat=chat, images=images).activations

    def capture_batch(self, sequences: Sequence[list[int]], capture: Sequence[str], prefix: Any = None,
                      stop_after_last_site: bool = True, positions: Sequence[Sequence[int]] | None = None,
                      interventions: Sequence[Any] = (), images: Any = None) -> dict[str, torch.Tensor]:
        if interventions:
            raise BadInputError("capture_batch with interventions runs in the process that holds the model; the "
                                "server's /capture_batch takes none (use trace per sequence, or an in-process engine)")
        body = {"sequences": [[int(t) for t in seq] for seq in sequences], "capture": list(capture),
                "prefix": self._state_id(prefix) if prefix is not None else None,
                "stop_after_last_site": stop_after_last_site,
                "positions": None if positions is None else [[int(p) for p in pos] for pos in positions]}
        if images is not None:  # one entry per sequence (None: a row without images), as base64 PNG
            body["images"] = _images_to_wire(images)
        return b64_to_tensors(self._call("POST", "/capture_batch", json=body)["activations"])

    def head_means(self, texts: Sequence[str], layer: int) -> torch.Tensor:
        body = {"texts": list(texts), "layer": layer}
        return b64_to_tensors(self._call("POST", "/head_means", json=body)["means"])["means"]

    def readout(self, vectors: torch.Tensor, *, norm: bool = True, top_k: int = 10, bottom_k: int = 0,
                token_ids: Sequence[int] | None = None) -> Readout:
        x = torch.as_tensor(vectors).detach().float().cpu()
        body = {"vectors": tensors_to_b64({"vectors": x.view(1, -1) if x.ndim == 1 else x}), "norm": norm,
                "top_k": top_k, "bottom_k": bottom_k,
                "token_ids": None if token_ids is None else [int(t) for t in token_ids]}
        return Readout(**b64_to_tensors(self._call("POST", "/readout", json=body)["readout"]))

    def minimize_entropy(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], site: str,
                         basis: torch.Tensor, *, iterations: int = 30, lr: float = 0.01, batch_size: int = 8,
                         seed: int = 0, on_step: Any = None) -> EntropyFit:
        """The fit runs on the server in one call; `on_step` is called once per iteration afterwards."""
        body = {"sequences": [[int(t) for t in seq] for seq in sequences], "starts": [int(s) for s in starts],
                "site": site, "basis": tensors_to_b64({"basis": torch.as_tensor(basis).detach().float().cpu()}),
                "iterations": iterations, "lr": float(lr), "batch_size": batch_size, "seed": seed}
        out = self._call("POST", "/minimize_entropy", json=body)
        fit = EntropyFit(b64_to_tensors(out["coefficients"])["coefficients"], list(out["history"]), out["settings"])
        if on_step:
            for i, value in enumerate(fit.history):
                on_step(i + 1, value)
        return fit

    def input_x_gradient(self, text: Any, *, target: str = "logprob", positions: Sequence[int] | None = None,
                         token: int | None = None, foil: int | None = None, sites: Sequence[str] = (),
                         interventions: Sequence[Any] = (), chat: bool = False,
                         images: Sequence[Any] | None = None) -> Any:
        from probes.gradients import GradientAttribution

        body = {"text": text, "target": target, "positions": None if positions is None else list(positions),
                "token": token, "foil": foil, "sites": list(sites),
                "interventions": [intervention_to_spec(iv) for iv in interventions], "chat": chat}
        if images is not None:
            body["images"] = _images_to_wire([images])[0]
        out = self._call("POST", "/input_x_gradient", json=body)
        tensors = b64_to_tensors(out.pop("tensors"))
        sites_out = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("site/")}
        return GradientAttribution(out["token_ids"], out["target"], out["positions"], tensors["scores"],
                                   out["target_value"], out["baseline_value"], sites_out)

    # ----- prefix states, held by the server -----

    def prefill(self, prompt: Any, chat: bool = False, base: Any = None, images: Any = None) -> RemotePrefix:
        body = {"prompt": prompt, "chat": chat, "base": self._state_id(base) if base is not None else None}
        if images is not None:
            body["images"] = _images_to_wire([images])[0]
        out = self._call("POST", "/prefill", retry=False, json=body)
        return RemotePrefix(out["state_id"], list(out["ids"]), out["fingerprint"], out["n_bytes"], self.url)

    def fork(self, state: Any, suffix: str | list[int], max_new_tokens: int = 16, capture: Sequence[str] = (),
             top_k: int = 5, stop: Sequence[str] = (), at: int | None = None,
             interventions: Sequence[Any] = ()) -> list[TokenRecord]:
        body = {"state": self._state_id(state), "suffix": suffix if isinstance(suffix, str) else [int(t) for t in suffix],
                "max_new_tokens": max_new_tokens, "capture": list(capture), "top_k": top_k, "stop": list(stop),
                "at": at, "interventions": [intervention_to_spec(iv) for iv in interventions]}
        return [record_from_json(row) for row in self._call("POST", "/fork", json=body)["records"]]

    def free(self, state: Any) -> None:
        self._call("POST", f"/free/{self._state_id(state)}")

    def head_gates(self, sink: int = 128, recent: int = 256, init: float = 1.0, gates: Any = None) -> Any:
        """Refused: capability "head_gates" is in-process only (the gates train against the model's weights)."""
        raise BadInputError("head gates need the model in this process (capability head_gates); load it with "
                            "--model instead of --server")

    def _state_id(self, state: Any) -> str:
        if not isinstance(state, RemotePrefix):
            raise BadInputError(f"{type(state).__name__} is not a prefix state of this server; make one with prefill()")
        if state.url and state.url != self.url:
            raise BadInputError(f"prefix state {state.id} belongs to the server at {state.url}, not {self.url}")
        return state.id

    def cancel(self, request_id: str) -> bool:
        """Ask the server to stop a generation at its next token; False if it is not queued or running."""
        return bool(self._call("POST", f"/cancel/{request_id}")["cancelled"])

    # ----- plumbing -----

    def _call(self, method: str, path: str, retry: bool = True, **kwargs: Any) -> Any:
        """One request; a connection the server dropped (a reset, a closed keep-alive) is retried once
        when `retry` (every operation but `prefill` is idempotent: repeating it changes nothing)."""
        if method == "POST" and not path.startswith(("/cancel/", "/free/")):  # model work, not its clean-up
            cancel.check()  # a job's Stop ends its work before its next model call (probes.cancel)
        for attempt in (0, 1):
            try:
                response = self._http.request(method, path, headers=self._ticket_header(), **kwargs)
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
                if attempt or not retry:
                    raise self._unreachable(err) from err
            except httpx.HTTPError as err:
                raise self._unreachable(err) from err
        if response.status_code >= 400:
            raise self._error_of(response)
        self._queue_ticket = None
        return response.json()

    @contextmanager
    def _open_stream(self, body: dict[str, Any]) -> Iterator[httpx.Response]:
        """One streaming POST /generate; an error status raises before any event is read."""
        cancel.check()  # a job's Stop ends its work before its next model call (probes.cancel)
        try:
            with self._http.stream("POST", "/generate", json=body, headers=self._ticket_header()) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._error_of(response)
                self._queue_ticket = None
                yield response
        except httpx.HTTPError as err:
            raise self._unreachable(err) from err

    def _ticket_header(self) -> dict[str, str]:
        ticket = self._queue_ticket
        return {QUEUE_TICKET_HEADER: ticket} if ticket else {}

    def _error_of(self, response: httpx.Response) -> ThoughtscopeError:
        err = _error_of(response)
        if isinstance(err, ServerBusyError) and getattr(err, "queue_ticket", None):
            self._queue_ticket = err.queue_ticket  # a retry of any call keeps this client's place
        return err

    def _unreachable(self, err: Exception) -> ThoughtscopeError:
        return ServerUnreachableError(self.url, f"{type(err).__name__}: {err}")


class ServerUnreachableError(ServerError):
    """The model server at `server_url` did not answer (`cause`: the transport's error); the app says so
    at the top of the page (app/outage.py)."""

    def __init__(self, server_url: str, cause: str):
        super().__init__(f"no answer from the model server at {server_url} ({cause}); "
                         "is `thoughtscope serve` running there, and is the URL right?")
        self.server_url, self.cause = server_url, cause

    def __reduce__(self) -> Any:  # a copy (pickled, e.g. from a job's worker) keeps both fields
        return type(self), (self.server_url, self.cause)


def _error_of(response: httpx.Response) -> ThoughtscopeError:
    try:
        body = response.json()
    except ValueError:
        body = None
    err = error_from_body(response.status_code, body, fallback=response.text[:200])
    if isinstance(err, ServerBusyError):
        try:
            err.retry_after = float(response.headers.get("Retry-After", 1))
        except ValueError:
            err.retry_after = 1.0
    return err


def _images_to_wire(per_prompt: Any) -> list[list[str]]:
    """One list of base64 PNG strings per prompt (an entry may be one image, a list of images, or None for
    a prompt without images); bad images fail here, before the request."""
    from probes.vision import image_to_b64

    if isinstance(per_prompt, (str, bytes)) or not isinstance(per_prompt, (list, tuple)):
        raise BadInputError("images must be a list: one image (or a list of images) per prompt")
    return [[image_to_b64(im) for im in (entry if isinstance(entry, (list, tuple)) else [] if entry is None else [entry])]
            for entry in per_prompt]

"""`RemoteBackend`: the Backend protocol over HTTP, talking to `thoughtscope serve`.

A page or an analysis takes a `Backend` and cannot tell this from the in-process `Engine`:
`generate` yields the same `TokenRecord`s (activations decoded from safetensors to tensors) as
the server makes them, `trace` returns the same `Trace`. Error responses become the project's
errors with the server's message; a full queue is a `ServerBusyError` with `retry_after`.

Example:
    >>> from probes.client import RemoteBackend
    >>> backend = RemoteBackend("http://127.0.0.1:8765", token=None)  # doctest: +SKIP
    >>> for rec in backend.generate("2 + 2 =", max_new_tokens=4):  # doctest: +SKIP
    ...     print(rec.text, rec.entropy)
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack, contextmanager
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from thoughtscope.errors import ThoughtscopeError
from probes.records import TokenRecord, Trace
from probes.wire import (
    ServerBusyError,
    ServerError,
    error_from_body,
    intervention_to_spec,
    parse_sse,
    record_from_json,
    sampling_to_spec,
    trace_from_json,
)


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
            for event, data in parse_sse(response.iter_lines()):
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
        rec = next(self._events)
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

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RemoteBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- the Backend protocol -----

    def info(self) -> dict[str, Any]:
        return self._call("GET", "/info")

    def sites(self) -> list[dict[str, Any]]:
        return self._call("GET", "/sites")

    def ready(self) -> dict[str, Any]:
        """Readiness and limits (busy, waiting, max_queue, max_new_tokens_cap); raises while loading."""
        return self._call("GET", "/ready")

    def generate(self, prompt: Any = None, *, prompts: Sequence[Any] | None = None, n_samples: int = 1,
                 max_new_tokens: int = 64, sampling: Any = None, seed: int = 0, capture: Sequence[str] = (),
                 interventions: Sequence[Any] = (), top_k: int = 5, stop: Sequence[str] = (),
                 chat: bool = False, request_id: str | None = None) -> RemoteStream:
        """Stream one record per new token (see `Engine.generate`). The request starts on the first `next`."""
        request_id = request_id or uuid.uuid4().hex
        body: dict[str, Any] = {
            "prompt": prompt, "prompts": None if prompts is None else list(prompts), "n_samples": n_samples,
            "max_new_tokens": max_new_tokens, "seed": seed, "capture": list(capture),
            "interventions": [intervention_to_spec(iv) for iv in interventions], "top_k": top_k,
            "stop": list(stop), "chat": chat, "request_id": request_id,
        }
        if sampling is not None:
            body["sampling"] = sampling_to_spec(sampling)
        return RemoteStream(self, request_id, body)

    def trace(self, text: Any, capture: Sequence[str] = (), interventions: Sequence[Any] = (),
              chat: bool = False) -> Trace:
        body = {"text": text, "capture": list(capture),
                "interventions": [intervention_to_spec(iv) for iv in interventions], "chat": chat}
        return trace_from_json(self._call("POST", "/trace", json=body))

    def cancel(self, request_id: str) -> bool:
        """Ask the server to stop a generation at its next token; False if it is not queued or running."""
        return bool(self._call("POST", f"/cancel/{request_id}")["cancelled"])

    # ----- plumbing -----

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise self._unreachable(err) from err
        if response.status_code >= 400:
            raise _error_of(response)
        return response.json()

    @contextmanager
    def _open_stream(self, body: dict[str, Any]) -> Iterator[httpx.Response]:
        """One streaming POST /generate; an error status raises before any event is read."""
        try:
            with self._http.stream("POST", "/generate", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error_of(response)
                yield response
        except httpx.HTTPError as err:
            raise self._unreachable(err) from err

    def _unreachable(self, err: Exception) -> ThoughtscopeError:
        return ServerError(f"no answer from the model server at {self.url} ({type(err).__name__}: {err}); "
                           "is `thoughtscope serve` running there, and is the URL right?")


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

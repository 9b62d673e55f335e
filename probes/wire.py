"""The model server's wire format, in one place: request bodies, records, traces, interventions, tensors.

Both `probes.server` and `probes.client` import this module, so the two ends cannot drift apart.
Tensors travel as safetensors bytes in base64 (never pickle: a payload is data, not code).
Request bodies are pydantic models with `extra="forbid"` and strict types, so a typo or a string
where a number belongs is a 422, not a silent default. Interventions travel as JSON specs: the
registered kind (`probes.interventions.KINDS`) and its constructor's arguments, tensors as
safetensors bytes; a new kind needs no change here.

Example:
    >>> import torch
    >>> from probes.interventions import AddVector
    >>> spec = intervention_to_spec(AddVector("resid_post.0", torch.ones(4), scale=2.0))
    >>> spec["kind"], spec["scale"]
    ('add', 2.0)
    >>> intervention_from_spec(spec).vector.tolist()
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from typing import Annotated, Any, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from thoughtscope.errors import (AuthError, BadInputError, InvalidRequestError, RequestTooLargeError,  # noqa: F401
                            ServerBusyError, ServerError, ThoughtscopeError)
from probes.interventions import KINDS, Registered, kind_of, load_vector_bytes
import probes.edits  # noqa: E402,F401  the steering edits and frozen attention register their kinds in KINDS
import probes.frozen_attention  # noqa: E402,F401  (a `thoughtscope serve` process imports nothing else of them)
from probes.records import TokenRecord, Trace

# Generous for any vector or prompt a page sends (a d_model=16384 float32 vector is 88 KB in base64),
# small enough that one client cannot make the server buffer gigabytes.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_NEW_TOKENS_CAP = 4096
MAX_BATCH = 64  # prompts x n_samples per request
MAX_INTERVENTIONS = 64  # interventions (steering, ablations, masks, a KV policy) per request
MAX_LR = 10.0  # the largest learning rate a gradient fit accepts (Adam steps are about lr each)
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
# A refused (503) client's place in line: the server sends it in this header and in the body; sent back with
# the retry, it keeps the client's place (probes.server.ModelQueue).
QUEUE_TICKET_HEADER = "X-Queue-Ticket"
# Keys GET /info adds beyond `Engine.info()` (what the server itself allows); `RemoteBackend.info()` sets them
# aside so that it equals the engine's own `info()`. A new server section is one more name here.
SERVER_INFO_KEYS = ("request_budget",)
# Tensor fields that hold one d_model vector: a tensor of another rank is refused, never flattened.
VECTOR_FIELDS = ("vector", "direction")


def error_body(err: BaseException) -> dict[str, Any]:
    """The JSON every error response carries: a message for the user and the error's class name."""
    if isinstance(err, ThoughtscopeError):
        return {"error": str(err), "kind": type(err).__name__}
    return {"error": f"internal error in the model server ({type(err).__name__}: {err}); see the server log",
            "kind": "ServerError"}


def error_from_body(status: int, body: Any, fallback: str = "") -> ThoughtscopeError:
    """An error response -> the matching `ThoughtscopeError` subclass, carrying the server's message."""
    from thoughtscope import errors

    message = body.get("error") if isinstance(body, dict) else None
    message = message or fallback or f"the model server answered HTTP {status}"
    kind = body.get("kind") if isinstance(body, dict) else None
    cls = getattr(errors, kind or "", None)  # every project error class lives in thoughtscope.errors
    if not (isinstance(cls, type) and issubclass(cls, ThoughtscopeError)):
        cls = {401: AuthError, 413: RequestTooLargeError, 422: InvalidRequestError, 503: ServerBusyError}.get(
            status, BadInputError if 400 <= status < 500 else ServerError)
    err = cls(message)
    err.http_status = status
    if isinstance(err, ServerBusyError):  # the precise wait (Retry-After is whole seconds) and the place in line
        given = body if isinstance(body, dict) else {}
        wait = given.get("retry_after_s")
        err.retry_after_s = float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool) else None
        err.queue_ticket = given.get("queue_ticket") if isinstance(given.get("queue_ticket"), str) else None
    return err


# ----- tensors -----


def tensors_to_b64(tensors: dict[str, torch.Tensor]) -> str:
    """A dict of tensors -> base64 text of one safetensors blob (CPU, contiguous, dtype kept)."""
    from safetensors.torch import save

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return base64.b64encode(save(cpu)).decode("ascii")


def b64_to_bytes(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise BadInputError(f"{what} is not valid base64 ({err}); send base64 of safetensors bytes") from err


def b64_to_tensors(text: str, what: str = "the tensor payload") -> dict[str, torch.Tensor]:
    """Inverse of `tensors_to_b64`; garbage is a `BadInputError` that says what was expected."""
    from safetensors.torch import load

    data = b64_to_bytes(text, what)
    try:
        return load(data)
    except Exception as err:  # safetensors raises several types for garbage input
        raise BadInputError(f"{what} is not valid safetensors bytes ({err}); build it with "
                            "base64(safetensors.torch.save({'vector': v}))") from err


# ----- request bodies -----


class _Body(BaseModel):
    # allow_inf_nan=False: Python's JSON parser reads NaN, Infinity and 1e400 (inf); no setting may be one
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


SiteName = Annotated[str, Field(max_length=64)]

Prompt = Union[str, list[dict[str, str]], list[int]]


class SamplingSpec(_Body):
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)


# An image travels as base64 of its encoded bytes (PNG from the client; probes.vision checks it).
ImageB64 = Annotated[str, Field(max_length=12 * 1024 * 1024)]


class GenerateRequest(_Body):
    """POST /generate. Mirrors `Engine.generate`; `request_id` lets a client cancel before the first token."""

    prompt: Prompt | None = None
    prompts: list[Prompt] | None = Field(None, max_length=MAX_BATCH)
    n_samples: int = Field(1, ge=1, le=MAX_BATCH)
    max_new_tokens: int = Field(64, ge=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    capture: list[SiteName] = Field(default_factory=list, max_length=512)
    interventions: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_INTERVENTIONS)
    top_k: int = Field(5, ge=0, le=100)
    stop: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=32)
    chat: bool = False
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    images: list[list[ImageB64]] | None = Field(None, max_length=MAX_BATCH)  # per prompt, for a VLM


class TraceRequest(_Body):
    """POST /trace. Mirrors `Engine.trace`."""

    text: Prompt
    capture: list[SiteName] = Field(default_factory=list, max_length=512)
    interventions: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_INTERVENTIONS)
    chat: bool = False
    images: list[ImageB64] | None = Field(None, max_length=16)  # for a VLM: one per <image> in text


MAX_SEQUENCES = 256  # sequences per capture_batch / entropy-fit request


class PrefillRequest(_Body):
    """POST /prefill. Mirrors `Engine.prefill`; `base` is a state id the server holds."""

    prompt: Prompt
    chat: bool = False
    base: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    images: list[ImageB64] | None = Field(None, max_length=16)  # for a VLM: one per <image> in prompt


class ForkRequest(_Body):
    """POST /fork. Mirrors `Engine.fork` on the state named `state`."""

    state: str = Field(pattern=REQUEST_ID_PATTERN)
    suffix: str | list[int]
    max_new_tokens: int = Field(16, ge=1)
    capture: list[SiteName] = Field(default_factory=list, max_length=512)
    top_k: int = Field(5, ge=0, le=100)
    stop: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=32)
    at: int | None = Field(None, ge=1)
    interventions: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_INTERVENTIONS)


class CaptureBatchRequest(_Body):
    """POST /capture_batch. Mirrors `Engine.capture_batch`; `prefix` is a state id."""

    sequences: list[list[int]] = Field(min_length=1, max_length=MAX_SEQUENCES)
    capture: list[SiteName] = Field(max_length=512)
    prefix: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    stop_after_last_site: bool = True
    positions: list[list[int]] | None = Field(None, max_length=MAX_SEQUENCES)
    images: list[list[ImageB64]] | None = Field(None, max_length=MAX_SEQUENCES)  # per sequence, for a VLM


class HeadMeansRequest(_Body):
    """POST /head_means. Mirrors `Engine.head_means`."""

    texts: list[str] = Field(min_length=1, max_length=MAX_SEQUENCES)
    layer: int = Field(ge=0)


class ReadoutRequest(_Body):
    """POST /readout. Mirrors `Engine.readout`; `vectors` is base64 safetensors of one [n, d] tensor."""

    vectors: str
    norm: bool = True
    top_k: int = Field(10, ge=0, le=100)
    bottom_k: int = Field(0, ge=0, le=100)
    token_ids: list[int] | None = None


class EntropyFitRequest(_Body):
    """POST /minimize_entropy. Mirrors `Engine.minimize_entropy`; `basis` is base64 safetensors."""

    sequences: list[list[int]] = Field(min_length=1, max_length=MAX_SEQUENCES)
    starts: list[int] = Field(min_length=1, max_length=MAX_SEQUENCES)
    site: str = Field(max_length=64)
    basis: str
    iterations: int = Field(30, ge=1, le=100_000)
    lr: float = Field(0.01, gt=0, le=MAX_LR)
    batch_size: int = Field(8, ge=1, le=1024)
    seed: int = Field(0, ge=0, le=2**63 - 1)


class GradientRequest(_Body):
    """POST /input_x_gradient. Mirrors `Engine.input_x_gradient`."""

    text: Prompt
    target: str = Field("logprob", max_length=32)
    positions: list[int] | None = Field(None, max_length=100_000)
    token: int | None = None
    foil: int | None = None
    sites: list[SiteName] = Field(default_factory=list, max_length=512)
    interventions: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_INTERVENTIONS)
    chat: bool = False
    images: list[ImageB64] | None = Field(None, max_length=16)  # for a VLM: one per <image> in text


def one_tensor(text: str, what: str) -> torch.Tensor:
    """The single tensor of a base64 safetensors payload."""
    tensors = b64_to_tensors(text, what)
    if len(tensors) != 1:
        raise BadInputError(f"{what} must hold exactly one tensor, not {sorted(tensors)}")
    return next(iter(tensors.values()))


# ----- interventions: any registered kind <-> JSON spec -----


def intervention_to_spec(iv: Any) -> dict[str, Any]:
    """A registered intervention (or KV policy, router rule, mask) -> its JSON spec; tensors as base64 safetensors."""
    if isinstance(iv, dict):  # already a spec
        return iv
    if not isinstance(iv, Registered):
        raise BadInputError(f"{iv!r} cannot be sent to the model server; use a kind from probes.interventions "
                            f"({', '.join(sorted(KINDS))})")
    spec = iv.spec()
    for name in type(iv).tensor_fields:
        if spec.get(name) is not None:
            spec[name] = tensors_to_b64({name: torch.as_tensor(spec[name], dtype=torch.float32)})
    return _jsonable(spec)


def intervention_from_spec(spec: Any) -> Any:
    """A JSON spec -> the registered class's instance; unknown kinds, fields or bad tensors are a 400.

    The instance is validated against the model by the engine, before any model work."""
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise InvalidRequestError(f"an intervention is a JSON object with a 'kind' ({', '.join(sorted(KINDS))})")
    fields = dict(spec)
    try:
        cls = kind_of(fields.pop("kind"))
    except BadInputError as err:
        raise InvalidRequestError(str(err)) from err
    unknown = sorted(set(fields) - set(cls.parameters()))
    if unknown:
        raise InvalidRequestError(f"{cls.kind!r} takes {cls.parameters()}; unknown field(s) {unknown}")
    for name in cls.tensor_fields:
        if fields.get(name) is not None:
            if not isinstance(fields[name], str):
                raise BadInputError(f"{cls.kind}.{name} must be base64 safetensors bytes")
            fields[name] = load_vector_bytes(b64_to_bytes(fields[name], f"{cls.kind}.{name}"))
            if name in VECTOR_FIELDS and fields[name].ndim != 1:
                raise BadInputError(f"{cls.kind}.{name} must be a 1-D vector of d_model values; got a tensor of "
                                    f"shape {list(fields[name].shape)} (send one vector, not a matrix)")
    return cls.from_spec(fields)


def _jsonable(value: Any) -> Any:
    """Tuples, numpy scalars and small tensors -> plain JSON values."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


# ----- records and traces -----


def sampling_to_spec(sampling: Any) -> dict[str, Any]:
    if sampling is None:
        return {}
    if isinstance(sampling, dict):
        return sampling
    return dataclasses.asdict(sampling)


def record_to_json(rec: TokenRecord) -> dict[str, Any]:
    row = rec.to_dict()
    row["activations"] = tensors_to_b64(rec.activations) if rec.activations else None
    return row


def records_to_json(records: list[TokenRecord]) -> list[dict[str, Any]]:
    return [record_to_json(r) for r in records]


def record_from_json(row: dict[str, Any]) -> TokenRecord:
    row = dict(row)
    blob = row.pop("activations", None)
    acts = b64_to_tensors(blob, "the record's activations") if blob else {}
    return TokenRecord(**row, activations=acts)


def trace_to_json(trace: Trace) -> dict[str, Any]:
    """Token fields as JSON; log-probs and entropies as tensors (logprobs[0] is NaN, which JSON lacks)."""
    return {
        "text": trace.text,
        "token_ids": list(trace.token_ids),
        "tokens": list(trace.tokens),
        "scores": tensors_to_b64({"logprobs": trace.logprobs, "entropies": trace.entropies}),
        "activations": tensors_to_b64(trace.activations) if trace.activations else None,
        "fired": tensors_to_b64(trace.fired) if trace.fired else None,  # steering terms' norms (probes.edits)
    }


def trace_from_json(body: dict[str, Any]) -> Trace:
    scores = b64_to_tensors(body["scores"], "the trace's scores")
    acts = b64_to_tensors(body["activations"], "the trace's activations") if body.get("activations") else {}
    fired = b64_to_tensors(body["fired"], "the trace's steering records") if body.get("fired") else {}
    return Trace(text=body["text"], token_ids=list(body["token_ids"]), tokens=list(body["tokens"]),
                 activations=acts, logprobs=scores["logprobs"], entropies=scores["entropies"], fired=fired)


# ----- Server-Sent Events -----


def strict_json(data: Any) -> Any:
    """`data` with every non-finite float (NaN, +-inf) replaced by None: strict JSON, as every parser reads it.

    The server's JSON never holds NaN or Infinity (documented in docs/server.md); where a value is
    undefined (the log-prob of a trace's first token) it travels inside a tensor payload instead.
    """
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: strict_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [strict_json(v) for v in data]
    return data


def dumps(data: Any) -> str:
    return json.dumps(strict_json(data), separators=(",", ":"), allow_nan=False)


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """One SSE event with strict JSON (non-finite numbers become null)."""
    return f"event: {event}\ndata: {dumps(data)}\n\n".encode()


def parse_sse(lines: Any) -> Any:
    """Text lines of an SSE stream -> (event, data dict) pairs; comments (keep-alives) are skipped."""
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        yield event, json.loads("\n".join(data))

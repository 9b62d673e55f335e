"""The model server's wire format, in one place: request bodies, records, traces, interventions, tensors.

Both `probes.server` and `probes.client` import this module, so the two ends cannot drift apart.
Tensors travel as safetensors bytes in base64 (never pickle: a payload is data, not code).
Request bodies are pydantic models with `extra="forbid"` and strict types, so a typo or a string
where a number belongs is a 422, not a silent default. Interventions travel as JSON specs
(`kind`: add | rescale | ablate_heads | mask_attention) and become the engine's dataclasses here.

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
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from probes.errors import (AuthError, BadInputError, InvalidRequestError, RequestTooLargeError,  # noqa: F401
                            ServerBusyError, ServerError, ThoughtscopeError)
from probes.interventions import AddVector, HeadAblation, MaskAttention, ProjectionRescale, load_vector_bytes
from probes.records import TokenRecord, Trace

# Generous for any vector or prompt a page sends (a d_model=16384 float32 vector is 88 KB in base64),
# small enough that one client cannot make the server buffer gigabytes.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_NEW_TOKENS_CAP = 4096
MAX_BATCH = 64  # prompts x n_samples per request
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def error_body(err: BaseException) -> dict[str, Any]:
    """The JSON every error response carries: a message for the user and the error's class name."""
    if isinstance(err, ThoughtscopeError):
        return {"error": str(err), "kind": type(err).__name__}
    return {"error": f"internal error in the model server ({type(err).__name__}: {err}); see the server log",
            "kind": "ServerError"}


def error_from_body(status: int, body: Any, fallback: str = "") -> ThoughtscopeError:
    """An error response -> the matching `ThoughtscopeError` subclass, carrying the server's message."""
    from probes import errors

    message = body.get("error") if isinstance(body, dict) else None
    message = message or fallback or f"the model server answered HTTP {status}"
    kind = body.get("kind") if isinstance(body, dict) else None
    cls = getattr(errors, kind or "", None)  # every project error class lives in probes.errors
    if not (isinstance(cls, type) and issubclass(cls, ThoughtscopeError)):
        cls = {401: AuthError, 413: RequestTooLargeError, 422: InvalidRequestError, 503: ServerBusyError}.get(
            status, BadInputError if 400 <= status < 500 else ServerError)
    err = cls(message)
    err.http_status = status
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
    model_config = ConfigDict(extra="forbid", strict=True)


Where = Literal["all", "generated"]


class AddSpec(_Body):
    """`AddVector`: h + scale * v. `vector` is base64 safetensors; `key` picks a tensor in it."""

    kind: Literal["add"]
    site: str = Field(max_length=64)
    vector: str
    key: str | None = None
    scale: float = 1.0
    where: Where = "all"


class RescaleSpec(_Body):
    """`ProjectionRescale`: h - alpha * w (w.h), w = the unit `vector`."""

    kind: Literal["rescale"]
    site: str = Field(max_length=64)
    vector: str
    key: str | None = None
    alpha: float = 1.0
    where: Where = "all"


class AblateHeadsSpec(_Body):
    """`HeadAblation` at `z.layer`; mean mode needs `means` [n_heads, head_dim] as base64 safetensors."""

    kind: Literal["ablate_heads"]
    layer: int = Field(ge=0)
    heads: list[int] = Field(max_length=4096)
    mode: Literal["zero", "mean"] = "zero"
    means: str | None = None
    key: str | None = None
    where: Where = "all"


class MaskAttentionSpec(_Body):
    """`MaskAttention`: generated tokens may not attend to these prompt positions."""

    kind: Literal["mask_attention"]
    positions: list[int] = Field(max_length=100_000)


InterventionSpec = Annotated[Union[AddSpec, RescaleSpec, AblateHeadsSpec, MaskAttentionSpec],
                             Field(discriminator="kind")]
_SPEC_ADAPTER = TypeAdapter(InterventionSpec)

Prompt = Union[str, list[dict[str, str]], list[int]]


class SamplingSpec(_Body):
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)


class GenerateRequest(_Body):
    """POST /generate. Mirrors `Engine.generate`; `request_id` lets a client cancel before the first token."""

    prompt: Prompt | None = None
    prompts: list[Prompt] | None = Field(None, max_length=MAX_BATCH)
    n_samples: int = Field(1, ge=1, le=MAX_BATCH)
    max_new_tokens: int = Field(64, ge=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    capture: list[str] = Field(default_factory=list, max_length=512)
    interventions: list[InterventionSpec] = Field(default_factory=list, max_length=64)
    top_k: int = Field(5, ge=0, le=100)
    stop: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=32)
    chat: bool = False
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)


class TraceRequest(_Body):
    """POST /trace. Mirrors `Engine.trace`."""

    text: Prompt
    capture: list[str] = Field(default_factory=list, max_length=512)
    interventions: list[InterventionSpec] = Field(default_factory=list, max_length=64)
    chat: bool = False


# ----- interventions: engine dataclass <-> JSON spec -----


def intervention_to_spec(iv: Any) -> dict[str, Any]:
    """An engine intervention -> its JSON spec (vectors as base64 safetensors)."""
    if isinstance(iv, AddVector):
        vec = torch.as_tensor(iv.vector, dtype=torch.float32)
        return {"kind": "add", "site": iv.site, "vector": tensors_to_b64({"vector": vec}),
                "scale": float(iv.scale), "where": iv.where}
    if isinstance(iv, ProjectionRescale):
        vec = torch.as_tensor(iv.direction, dtype=torch.float32)
        return {"kind": "rescale", "site": iv.site, "vector": tensors_to_b64({"vector": vec}),
                "alpha": float(iv.alpha), "where": iv.where}
    if isinstance(iv, HeadAblation):
        spec = {"kind": "ablate_heads", "layer": int(iv.site.split(".", 1)[1]), "heads": [int(h) for h in iv.heads],
                "mode": iv.mode, "where": iv.where}
        if iv.means is not None:
            spec["means"] = tensors_to_b64({"means": torch.as_tensor(iv.means, dtype=torch.float32)})
        return spec
    if isinstance(iv, MaskAttention):
        return {"kind": "mask_attention", "positions": [int(p) for p in iv.positions]}
    if isinstance(iv, dict):  # already a spec
        return iv
    raise BadInputError(f"{iv!r} cannot be sent to the model server; use AddVector, ProjectionRescale, "
                        "HeadAblation or MaskAttention from probes.interventions")


def intervention_from_spec(spec: Any) -> Any:
    """A validated spec (pydantic model or dict) -> an engine intervention; bad tensors are a 400."""
    if isinstance(spec, dict):
        spec = _SPEC_ADAPTER.validate_python(spec)
    if isinstance(spec, AddSpec):
        return AddVector(spec.site, _vector(spec.vector, spec.key, f"vector of 'add' at {spec.site}"),
                         scale=spec.scale, where=spec.where)
    if isinstance(spec, RescaleSpec):
        return ProjectionRescale(spec.site, _vector(spec.vector, spec.key, f"vector of 'rescale' at {spec.site}"),
                                 alpha=spec.alpha, where=spec.where)
    if isinstance(spec, AblateHeadsSpec):
        means = None if spec.means is None else _vector(spec.means, spec.key, "means of 'ablate_heads'", flat=False)
        return HeadAblation(spec.layer, spec.heads, mode=spec.mode, means=means, where=spec.where)
    return MaskAttention(list(spec.positions))


def _vector(text: str, key: str | None, what: str, flat: bool = True) -> torch.Tensor:
    try:
        tensor = load_vector_bytes(b64_to_bytes(text, what), key=key)
    except BadInputError as err:
        raise BadInputError(f"{what}: {err}") from err
    return tensor.flatten() if flat else tensor


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
    }


def trace_from_json(body: dict[str, Any]) -> Trace:
    scores = b64_to_tensors(body["scores"], "the trace's scores")
    acts = b64_to_tensors(body["activations"], "the trace's activations") if body.get("activations") else {}
    return Trace(text=body["text"], token_ids=list(body["token_ids"]), tokens=list(body["tokens"]),
                 activations=acts, logprobs=scores["logprobs"], entropies=scores["entropies"])


# ----- Server-Sent Events -----


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """One SSE event. JSON allows no NaN, but Python's reader does, and a log-prob may be -inf."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


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

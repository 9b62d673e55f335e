"""`thoughtscope serve`: hold a model in this process and serve it over HTTP (see `probes.server`)."""

from __future__ import annotations

from typing import Optional

import typer

from probes.server import BUDGET, DEFAULT_HOST, DEFAULT_PORT, ServerLimits, serve
from probes.states import DEFAULT_MAX_STATE_BYTES, DEFAULT_MAX_STATES, DEFAULT_STATE_TTL_S
from probes.wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_NEW_TOKENS_CAP
from probes.zoo import check_load_options
from thoughtscope import checks


def _budget(name: str) -> int:
    """A request-budget option: its default from ServerLimits, its help from the one table (probes.server.BUDGET)."""
    return typer.Option(getattr(ServerLimits, name), f"--{name.replace('_', '-')}",
                        help=f"request budget: {BUDGET[name]} (413 beyond, before any model work)")


def register(cli: typer.Typer) -> None:
    @cli.command("serve")
    def serve_command(
        model: str = typer.Option("smollm2-135m", help="smollm2-135m, hf:<repo or folder>, tiny-random:<arch>"),
        host: str = typer.Option(DEFAULT_HOST, help="address to bind; anything but loopback needs --token"),
        port: int = typer.Option(DEFAULT_PORT, min=1, max=65535),
        device: str = typer.Option("auto", help="cpu, cuda, cuda:1 or auto (CUDA when present)"),
        dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: bf16 on CUDA)"),
        device_map: Optional[str] = typer.Option(
            None, "--device-map", help="auto | balanced | sequential (layers over this machine's GPUs, accelerate), or "
                                       "a JSON map module -> 0 / cuda:1 / cpu / disk (text or a .json file); "
                                       "probes.sharding"),
        token: Optional[str] = typer.Option(
            None, envvar="THOUGHTSCOPE_TOKEN", help="bearer token clients must send (env THOUGHTSCOPE_TOKEN keeps it "
                                                    "out of the process list)"),
        max_queue: int = typer.Option(8, help="requests that may wait for the model; beyond it: 503 + Retry-After"),
        max_new_tokens_cap: int = typer.Option(DEFAULT_MAX_NEW_TOKENS_CAP, help="largest max_new_tokens accepted"),
        max_body_bytes: int = typer.Option(DEFAULT_MAX_BODY_BYTES, help="largest request body accepted (413 beyond)"),
        max_states: int = typer.Option(DEFAULT_MAX_STATES, help="prefix states (KV caches) held for forks; LRU beyond"),
        max_state_bytes: int = typer.Option(DEFAULT_MAX_STATE_BYTES, help="bytes all prefix states may hold together"),
        state_ttl_s: float = typer.Option(DEFAULT_STATE_TTL_S, help="a prefix state unused this long expires"),
        send_timeout_s: float = typer.Option(ServerLimits.send_timeout_s,
                                             help="a stream whose client takes no data this long is cut off"),
        max_stream_s: float = typer.Option(ServerLimits.max_stream_s, help="longest a generation or an entropy fit may hold the model"),
        queue_timeout_s: float = typer.Option(ServerLimits.queue_timeout_s,
                                              help="longest a request waits for the model before a 503"),
        read_timeout_s: float = typer.Option(ServerLimits.read_timeout_s,
                                             help="longest a client may pause while sending a request body (408)"),
        max_sequences: int = _budget("max_sequences"),
        max_batch_tokens: int = _budget("max_batch_tokens"),
        max_capture_tokens: int = _budget("max_capture_tokens"),
        max_capture_sequences: int = _budget("max_capture_sequences"),
        max_interventions: int = _budget("max_interventions"),
        max_images: int = _budget("max_images"),
        max_image_side: int = _budget("max_image_side"),
        max_image_pixels: int = _budget("max_image_pixels"),
        max_request_pixels: int = _budget("max_request_pixels"),
        log_level: str = typer.Option("info", help="uvicorn log level"),
        trust_remote_code: bool = typer.Option(
            False, "--trust-remote-code", help="let an hf: model folder run its own modeling code (only if you trust it)"),
        validate: bool = typer.Option(
            False, "--validate", help="validate the model in the background once loaded (thoughtscope validate), so "
                                      "/info and the pages carry its correctness badge"),
    ) -> None:
        """Serve a model over HTTP: streamed generation (SSE), traces, interventions; the app connects with
        `RemoteBackend(url, token)`.

        Every request is measured against the request budget (the --max-* options below: rows, tokens x rows,
        interventions, images and their pixels as the image headers declare them) before any model work and
        before it takes a place in the queue; GET /info reports the budget under "request_budget"."""
        checks.choice("--log-level", log_level, ("critical", "error", "warning", "info", "debug", "trace"))
        check_load_options(model, device, dtype, device_map)  # before uvicorn says it is running
        checks.free_port(host, port)  # before the model loads
        serve(model, host=host, port=port, token=token, max_queue=max_queue, max_body_bytes=max_body_bytes,
              max_new_tokens_cap=max_new_tokens_cap, device=device, dtype=dtype, device_map=device_map,
              log_level=log_level, trust_remote_code=trust_remote_code, max_states=max_states,
              max_state_bytes=max_state_bytes, state_ttl_s=state_ttl_s, validate=validate,
              limits=ServerLimits(send_timeout_s=send_timeout_s, max_stream_s=max_stream_s,
                                  queue_timeout_s=queue_timeout_s, read_timeout_s=read_timeout_s,
                                  max_sequences=max_sequences,
                                  max_batch_tokens=max_batch_tokens, max_capture_tokens=max_capture_tokens,
                                  max_capture_sequences=max_capture_sequences, max_interventions=max_interventions,
                                  max_images=max_images, max_image_side=max_image_side,
                                  max_image_pixels=max_image_pixels, max_request_pixels=max_request_pixels))

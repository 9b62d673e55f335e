"""`thoughtscope serve`: hold a model in this process and serve it over HTTP (see `probes.server`)."""

from __future__ import annotations

from typing import Optional

import typer

from probes.server import DEFAULT_HOST, DEFAULT_PORT, serve
from probes.wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_NEW_TOKENS_CAP


def register(cli: typer.Typer) -> None:
    @cli.command("serve")
    def serve_command(
        model: str = typer.Option("smollm2-135m", help="smollm2-135m, hf:<repo or folder>, tiny-random:<arch>"),
        host: str = typer.Option(DEFAULT_HOST, help="address to bind; anything but loopback needs --token"),
        port: int = typer.Option(DEFAULT_PORT),
        device: str = typer.Option("auto", help="cpu, cuda, cuda:1 or auto (CUDA when present)"),
        dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: bf16 on CUDA)"),
        device_map: Optional[str] = typer.Option(
            None, "--device-map", help="'auto' shards an hf: model over this machine's GPUs (accelerate)"),
        token: Optional[str] = typer.Option(
            None, envvar="THOUGHTSCOPE_TOKEN", help="bearer token clients must send (env THOUGHTSCOPE_TOKEN keeps it "
                                                    "out of the process list)"),
        max_queue: int = typer.Option(8, help="requests that may wait for the model; beyond it: 503 + Retry-After"),
        max_new_tokens_cap: int = typer.Option(DEFAULT_MAX_NEW_TOKENS_CAP, help="largest max_new_tokens accepted"),
        max_body_bytes: int = typer.Option(DEFAULT_MAX_BODY_BYTES, help="largest request body accepted (413 beyond)"),
        log_level: str = typer.Option("info", help="uvicorn log level"),
        trust_remote_code: bool = typer.Option(
            False, "--trust-remote-code", help="let an hf: model folder run its own modeling code (only if you trust it)"),
    ) -> None:
        """Serve a model over HTTP: streamed generation (SSE), traces, interventions; the app connects with
        `RemoteBackend(url, token)`."""
        serve(model, host=host, port=port, token=token, max_queue=max_queue, max_body_bytes=max_body_bytes,
              max_new_tokens_cap=max_new_tokens_cap, device=device, dtype=dtype, device_map=device_map,
              log_level=log_level, trust_remote_code=trust_remote_code)

"""`python -m benchmarks.server_load`: the model server under load, a stalled client, and its memory (README, Reliability).

Starts `thoughtscope serve` in a subprocess, then:
- load: `--requests` requests (mixed /generate streams and /trace calls) from `--clients` threads, each
  retrying a 503 at most `--max-retries` times (default 5) after the wait the server asks for
  (`retry_after_s`), sending back its place in line (`X-Queue-Ticket`); counts requests lost (no answer,
  refused more often than the retry limit, or an answer that is not the one asked for), the 503s and
  the most retries one request needed, latency p50/p95, and the server's RSS before and after (growth).
  `--max-queue` sets the server's waiting room (default: one place per client, so a 503 needs
  contention; `--max-queue 2` makes most arrivals wait in line);
- stalled client: a stream that asks for big records and never reads; the time until the model is
  free again (the server's send deadline cuts it off) and whether the next request then runs.

Prints one JSON object per measurement, e.g.
    python -m benchmarks.server_load --model tiny-random:llama --requests 300 --clients 16 --max-retries 5
    python -m benchmarks.server_load --model smollm2-135m --requests 50 --clients 4
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from probes.server_bench import free_port, server_log, start_server, stop_server, wait_ready
from probes.wire import QUEUE_TICKET_HEADER


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _busy_wait(r: httpx.Response) -> tuple[float, str | None]:
    """(seconds to wait, queue ticket) of a 503: the body's precise wait, else the whole-second Retry-After."""
    try:
        body = json.loads(r.read())
    except ValueError:
        body = {}
    return float(body.get("retry_after_s") or r.headers.get("Retry-After", 1)), r.headers.get(QUEUE_TICKET_HEADER)


def _one(url: str, i: int, max_retries: int) -> tuple[float, bool, int]:
    """One request (every third a /trace, the rest 8-token streams); (seconds, answered correctly, 503s)."""
    start, ticket = time.monotonic(), None
    for attempt in range(max_retries + 1):
        headers = {QUEUE_TICKET_HEADER: ticket} if ticket else {}
        try:
            if i % 3 == 0:
                r = httpx.post(f"{url}/trace", json={"text": f"request {i}: 2 + 2 ="}, headers=headers, timeout=300)
                if r.status_code == 503:
                    wait, ticket = _busy_wait(r)
                    time.sleep(wait)
                    continue
                ok = r.status_code == 200 and len(r.json()["token_ids"]) > 3
                return time.monotonic() - start, ok, attempt
            with httpx.stream("POST", f"{url}/generate", json={"prompt": f"request {i}", "max_new_tokens": 8},
                              headers=headers, timeout=300) as r:
                if r.status_code == 503:
                    wait, ticket = _busy_wait(r)
                    time.sleep(wait)
                    continue
                text = r.read().decode()
                ok = r.status_code == 200 and text.count("event: token") == 8 and "event: end" in text
                return time.monotonic() - start, ok, attempt
        except httpx.HTTPError:
            return time.monotonic() - start, False, attempt
    return time.monotonic() - start, False, max_retries + 1


def load(url: str, pid: int, requests: int, clients: int, max_retries: int) -> dict:
    _one(url, 1, max_retries)  # warm-up
    rss_before = _rss_mb(pid)
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: _one(url, i, max_retries), range(requests)))
    wall = time.monotonic() - start
    latencies = sorted(t for t, _, _ in results)
    cuts = statistics.quantiles(latencies, n=20)
    return {"bench": "server_load", "requests": requests, "clients": clients, "max_retries": max_retries,
            "lost": sum(not ok for _, ok, _ in results), "busy_503s": sum(n for _, _, n in results),
            "most_retries": max(n for _, _, n in results), "p50_ms": round(cuts[9] * 1000),
            "p95_ms": round(cuts[18] * 1000), "wall_s": round(wall, 1), "rss_before_mb": round(rss_before),
            "rss_after_mb": round(_rss_mb(pid)), "rss_growth_mb": round(_rss_mb(pid) - rss_before, 1)}


def stalled_client(url: str) -> dict:
    """A stream of 260 KB records that is never read: how long until the model is free again."""
    body = json.dumps({"prompt": "a b c", "max_new_tokens": 2000, "capture": ["logits"], "top_k": 0}).encode()
    host, port = url.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    start = time.monotonic()
    try:
        time.sleep(0.5)
        while httpx.get(f"{url}/ready").json()["busy"]:
            time.sleep(0.1)
        freed = time.monotonic() - start
        next_ok = httpx.post(f"{url}/trace", json={"text": "after the stall"}, timeout=120).status_code == 200
    finally:
        sock.close()
    limit = httpx.get(f"{url}/ready").json()["limits"]["send_timeout_s"]
    return {"bench": "server_stalled_client", "model_free_after_s": round(freed, 1), "send_timeout_s": limit,
            "next_request_ok": next_ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-random:llama")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--send-timeout-s", type=float, default=10.0)
    parser.add_argument("--max-retries", type=int, default=5, help="503s a request may get before it counts as lost")
    parser.add_argument("--max-queue", type=int, default=None, help="the server's waiting room (default: --clients)")
    args = parser.parse_args(argv)
    port = free_port()
    max_queue = args.clients if args.max_queue is None else args.max_queue
    proc = start_server(args.model, port, device="cpu", extra=(
        f"max_queue={max_queue}, limits=__import__('probes.server', fromlist=['ServerLimits']).ServerLimits("
        f"send_timeout_s={args.send_timeout_s})"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout=600)
        for row in (load(url, proc.pid, args.requests, args.clients, args.max_retries), stalled_client(url)):
            print(json.dumps({**row, "model": args.model, "max_queue": max_queue}), flush=True)
    finally:
        stop_server(proc)
    log = server_log(proc)
    return 1 if "Traceback" in log else 0


if __name__ == "__main__":
    sys.exit(main())

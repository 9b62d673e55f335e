"""The model server against hostile or careless clients (issue 10): each test failed on the server as it was.

A never-reading client is cut off and the next request runs; a queued client that gives up frees
its place; batches, token ids, numbers and strings are checked before any model work; a 500 keeps
the connection; a request id is reserved atomically; the JSON is strict.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from probes.client import RemoteBackend
from probes.server_bench import free_port, server_log, start_server, stop_server, wait_ready
from thoughtscope.errors import BadInputError

MODEL = "tiny-random:llama"
LIMITS = ("limits=__import__('probes.server', fromlist=['ServerLimits']).ServerLimits("
          "send_timeout_s=2.0, max_stream_s=60.0, queue_timeout_s=30.0, max_sequences=16, max_batch_tokens=2048)")


@pytest.fixture(scope="module")
def url():
    port = free_port()
    proc = start_server(MODEL, port, device="cpu", extra=f"max_queue=1, {LIMITS}")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout=180)
        yield url
    finally:
        stop_server(proc)


def _wait_idle(url: str, timeout: float = 60.0) -> float:
    start = time.monotonic()
    while True:
        ready = httpx.get(f"{url}/ready").json()
        if not ready["busy"] and not ready["waiting"]:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"the model stayed busy: {ready}"
        time.sleep(0.1)


def _strict(text: str):
    def refuse(constant):
        raise AssertionError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_client_that_never_reads_is_cut_off_and_the_next_request_runs(url):
    body = json.dumps({"prompt": "a b c", "max_new_tokens": 500, "capture": ["logits"], "top_k": 0}).encode()
    host, port = url.rsplit("/", 1)[1].split(":")
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small buffers: the stall shows quickly
    stalled.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        time.sleep(1.0)
        assert httpx.get(f"{url}/ready").json()["busy"], "the stalled stream should hold the model at first"
        freed_after = _wait_idle(url, timeout=45)  # send_timeout_s is 2 s; every logits record is ~260 KB
        r = httpx.post(f"{url}/trace", json={"text": "2 + 2"}, timeout=30)
        assert r.status_code == 200 and freed_after < 45
    finally:
        stalled.close()


def test_a_queued_client_that_gives_up_frees_its_place(url):
    # One stream holds the model until the test cancels it: its client reads the large logits records slowly,
    # so the bounded send buffer keeps the producer waiting (a fixed token count is not enough: a fast machine
    # runs a tiny model to its 512-token context within a second). max_queue=1: one waiting place.
    done = threading.Event()

    def hold():
        body = {"prompt": "x", "max_new_tokens": 500, "capture": ["logits"], "top_k": 0, "request_id": "holder"}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
            for _ in r.iter_bytes(65536):
                if done.is_set():
                    return
                time.sleep(0.05)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while not httpx.get(f"{url}/ready").json()["busy"]:
            assert time.monotonic() < deadline, "the holder never started"
            time.sleep(0.05)
        with pytest.raises(httpx.ReadTimeout):  # it gives up after 1 s, while waiting for the model
            httpx.post(f"{url}/trace", json={"text": "hello"}, timeout=1.0)
        time.sleep(1.5)  # the server notices the disconnect within its 0.5 s poll
        ready = httpx.get(f"{url}/ready").json()
        assert ready["busy"] and ready["waiting"] == 0  # the model is still held, yet the place is free
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}/trace", json={"text": "hello"}, timeout=120)))
        waiter.start()
        while httpx.get(f"{url}/ready").json()["waiting"] == 0 and waiter.is_alive():
            time.sleep(0.05)
    finally:
        httpx.post(f"{url}/cancel/holder")
        done.set()
        holder.join()
    waiter.join()
    assert answers[0].status_code == 200, answers[0].text  # queued in the freed place, not refused with a 503
    _wait_idle(url)


@pytest.mark.parametrize("body, status, words", [
    ({"prompts": ["a"] * 4, "n_samples": 8, "max_new_tokens": 2}, 413, "at most 16"),  # 32 sequences > 16
    ({"prompt": "a", "n_samples": 16, "max_new_tokens": 200}, 413, "at most 2048"),  # 3200 batch tokens > 2048
    ({"prompt": [49152], "max_new_tokens": 2}, 400, "outside this model's vocabulary"),
    ({"prompt": [-3], "max_new_tokens": 2}, 400, "outside this model's vocabulary"),
    ({"prompt": [], "max_new_tokens": 2}, 400, "an empty list holds neither token ids nor chat messages"),
    ({"prompt": "hi", "stop": [""]}, 400, "non-empty"),
    ({"prompt": "hi", "capture": ["resid_post." + "9" * 5000]}, 422, "at most 64 characters"),
    ({"prompt": [{"role": "user", "content": "x" * 200_001}]}, 400, "limit is 200000"),
    ({"prompt": "hi", "interventions": [{"kind": "ablate_heads", "layer": 0, "heads": [0], "mode": "mean",
                                         "means": None}]}, 400, "needs means"),
])
def test_bad_generate_requests_are_refused_before_any_model_work(url, body, status, words):
    r = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_non_finite_numbers_are_refused_and_the_json_is_strict(url):
    from probes.wire import intervention_to_spec
    from probes.interventions import AddVector, HeadAblation
    import torch

    huge = intervention_to_spec(AddVector("resid_post.0", torch.ones(64), scale=1.0))
    huge["scale"] = 1e308
    r = httpx.post(f"{url}/generate", json={"prompt": "hi", "interventions": [huge]})
    assert r.status_code == 400 and "magnitude" in r.json()["error"]
    nan_means = intervention_to_spec(HeadAblation(0, [0], mode="mean", means=torch.zeros(4, 16)))
    nan_means["means"] = intervention_to_spec(AddVector("resid_post.0", torch.full((64,), float("nan"))))["vector"]
    r = httpx.post(f"{url}/generate", json={"prompt": "hi", "interventions": [nan_means]})
    assert r.status_code == 400, r.text
    r = httpx.post(f"{url}/generate", json={"prompt": "2 + 2 =", "max_new_tokens": 4})
    for line in r.text.splitlines():
        if line.startswith("data:"):
            _strict(line[5:])
    _strict(httpx.post(f"{url}/trace", json={"text": "2 + 2 ="}).text)


def test_odd_bytes_and_strings_are_bad_input_not_server_errors(url):
    r = httpx.post(f"{url}/trace", content=b'{"text": "\\ud800"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]
    r = httpx.post(f"{url}/trace", content=b'{"text": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500 and r.json()["kind"] != "ServerError"


def test_duplicate_request_ids_one_wins_one_gets_409(url):
    def post(_):
        return httpx.post(f"{url}/generate", json={"prompt": "x y", "max_new_tokens": 400, "request_id": "same-id"},
                          timeout=60).status_code

    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            assert sorted(pool.map(post, range(2))) == [200, 409]
        _wait_idle(url)


def test_a_server_error_keeps_the_connection_and_the_client_retries():
    """A bug in the server (here: an engine whose trace raises) is a JSON 500, and the next call works."""
    import uvicorn

    from probes.engine import Engine
    from probes.server import create_app

    class Broken(Engine):
        def trace(self, *args, **kwargs):
            raise RuntimeError("a bug")

    app = create_app(Broken.from_id(MODEL, device="cpu"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with httpx.Client(base_url=base) as client:  # one keep-alive connection, no retries
            for _ in range(10):
                r = client.post("/trace", json={"text": "hi"})
                assert r.status_code == 500 and r.json()["kind"] == "ServerError" and "a bug" in r.json()["error"]
                assert client.get("/health").status_code == 200
        with RemoteBackend(base) as remote:
            assert remote.info()["model_id"] == MODEL
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_token_that_can_never_match_is_refused_at_start():
    from probes.server import create_app

    with pytest.raises(BadInputError, match="printable ASCII"):
        create_app("tiny-random:llama", token="clé")


def test_the_cli_turns_bad_numbers_and_bytes_into_one_line_errors(monkeypatch, capsys):
    from thoughtscope import cli

    for argv, says in (
            # the seed's range is the command line's own check since 2026-12-07 (typer's usage error)
            (["generate", "--model", MODEL, "--prompt", "hi", "--seed", "18446744073709551616"],
             "Invalid value for '--seed': Input should be less than or equal to 2147483647"),
            (["generate", "--model", MODEL, "--prompt", "caf\udce9"], "error:")):  # a non-UTF-8 byte, as argv has it
        monkeypatch.setattr("sys.argv", ["thoughtscope", *argv])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        err = " ".join(capsys.readouterr().err.replace("│", " ").split())
        assert exit_info.value.code == 2 and "Traceback" not in err and says in err, err

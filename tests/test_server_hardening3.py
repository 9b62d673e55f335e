"""The model server, round three (a fuzzing pass of 2026-12-07): each test failed on the server as it was.

Repeated positions no longer multiply what a gradient or a capture holds (one request had the server
killed for memory); a long entropy fit stops when its client leaves or at `--max-stream-s`; booleans are
not head numbers; a temperature too small for float32 is refused; a SnapKV kernel wider than the context,
frozen attention beside a layer-chosen mask, frozen-attention rows beyond the batch, an empty fork stop
string and a steering vector whose entries overflow float32 are 400s before any model work; a stalled
upload gets a 408. The servers run in this process, so each test counts the model's forward calls.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import torch

from probes import Engine
from probes.server import ServerLimits
from probes.wire import tensors_to_b64
from tests.counting import ForwardCounter, counted_tiny_server

LIMITS = ServerLimits(max_stream_s=3.0, read_timeout_s=1.0)


@pytest.fixture(scope="module")
def llama():
    with counted_tiny_server(LIMITS) as served:
        yield served


def _refused(url: str, counter: ForwardCounter, path: str, body: dict, words: str, status: int = 400) -> None:
    before = counter.calls
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    assert words in r.json()["error"], r.json()["error"]
    assert counter.calls == before


def _wait_idle(url: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while (ready := httpx.get(f"{url}/ready").json())["busy"] or ready["waiting"]:
        assert time.monotonic() < deadline, f"the model stayed busy: {ready}"
        time.sleep(0.1)


# ----- repeated positions cannot multiply the [positions, vocab] rows -----


def test_repeated_gradient_target_positions_are_refused_before_model_work(llama):
    url, _, counter = llama
    _refused(url, counter, "/input_x_gradient", {"text": "hello there world", "positions": [1] * 1000},
             "target positions repeat: [1]")


def test_more_capture_positions_than_tokens_are_refused_before_model_work(llama):
    url, _, counter = llama
    _refused(url, counter, "/capture_batch", {"sequences": [[1, 2, 3]], "capture": ["logits"],
                                              "positions": [[0] * 4]},
             "4 positions for a sequence of 3 tokens")
    ok = httpx.post(f"{url}/capture_batch", json={"sequences": [[1, 2, 3]], "capture": ["logits"],
                                                  "positions": [[0, 2, 2]]}, timeout=60)
    assert ok.status_code == 200, ok.text  # a repeat within the sequence's own length stays allowed


def test_captured_logits_at_chosen_positions_are_those_of_a_plain_forward(llama):
    """capture_batch computed the last position's logits only, so `logits` at position 0 came back as the
    last position's (and position 2 of 3 was an IndexError, a 500 through the server)."""
    _, engine, _ = llama
    ids = engine.encode("one two three four")
    with torch.no_grad():
        plain = engine.model(input_ids=torch.tensor([ids])).logits[0]
    got = engine.capture_batch([ids], ["logits"], positions=[[0, 2, 2]])["logits"]
    torch.testing.assert_close(got, plain[[0, 2, 2]], rtol=1e-5, atol=1e-5)
    whole = engine.capture_batch([ids], ["logits"])["logits"]
    torch.testing.assert_close(whole[0], plain, rtol=1e-5, atol=1e-5)


# ----- a long entropy fit: its client leaving stops it, and so does --max-stream-s -----


def _fit_body(engine: Engine, iterations: int) -> dict:
    return {"sequences": [engine.encode("2 + 2 = 4 and 3 + 3 = 6")], "starts": [3], "site": "resid_post.0",
            "iterations": iterations,
            "basis": tensors_to_b64({"basis": torch.randn(2, 64, generator=torch.Generator().manual_seed(0))})}


def test_an_entropy_fit_stops_at_max_stream_s_and_says_how_far_it_got(llama):
    url, engine, _ = llama
    r = httpx.post(f"{url}/minimize_entropy", json=_fit_body(engine, 100_000), timeout=120)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert "--max-stream-s" in error and "of 100000 iterations" in error
    assert httpx.post(f"{url}/trace", json={"text": "2 + 2"}, timeout=60).status_code == 200


def test_an_entropy_fit_whose_client_leaves_frees_the_model(llama):
    url, engine, counter = llama
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/minimize_entropy", json=_fit_body(engine, 100_000), timeout=0.5)
    _wait_idle(url)
    after = counter.calls
    time.sleep(0.5)
    assert counter.calls == after  # no iteration runs for a client that has gone
    assert httpx.post(f"{url}/trace", json={"text": "2 + 2"}, timeout=60).status_code == 200


# ----- intervention fields that reached the model -----


@pytest.mark.parametrize("path", ["/trace", "/input_x_gradient"])
def test_booleans_are_not_head_numbers(llama, path):
    url, _, counter = llama
    _refused(url, counter, path, {"text": "a b c", "interventions": [{"kind": "ablate_heads", "layer": 0,
                                                                      "heads": [True]}]},
             "heads [True] out of range")


def test_a_temperature_below_float32s_reach_is_a_400_before_the_stream(llama):
    url, _, counter = llama
    _refused(url, counter, "/generate", {"prompt": "hello world", "max_new_tokens": 2,
                                         "sampling": {"temperature": 1e-40}},
             "use 0 for greedy decoding")


def test_a_snapkv_kernel_wider_than_the_context_is_a_400_before_the_stream(llama):
    url, engine, counter = llama
    _refused(url, counter, "/generate", {"prompt": "one two three four five six", "max_new_tokens": 3,
                                         "interventions": [{"kind": "kv_snapkv", "budget": 2, "window": 1,
                                                            "kernel": 2**31 + 1}]},
             f"SnapKVPolicy.kernel must be an integer in 1..{engine.arch().context_length}")


def test_frozen_attention_beside_a_layer_chosen_mask_is_a_400_before_the_stream(llama):
    url, _, counter = llama
    _refused(url, counter, "/generate", {"prompt": "a b c", "max_new_tokens": 3, "interventions": [
        {"kind": "frozen_attention"}, {"kind": "mask_attention", "positions": [0], "layers": [0]}]},
        "cannot be combined with frozen attention")


def test_frozen_attention_rows_beyond_a_traces_batch_are_refused(llama):
    url, _, counter = llama
    _refused(url, counter, "/trace", {"text": "a b c", "interventions": [{"kind": "frozen_attention", "rows": [5]}]},
             "frozen attention names rows [5] but the call runs 1 rows")


def test_an_empty_fork_stop_string_is_refused(llama):
    url, _, counter = llama
    state = httpx.post(f"{url}/prefill", json={"prompt": "one two three"}, timeout=60).json()["state_id"]
    _refused(url, counter, "/fork", {"state": state, "suffix": " x", "stop": [""], "max_new_tokens": 5},
             "stop must be a list of non-empty strings")
    assert httpx.post(f"{url}/fork", json={"state": state, "suffix": " x", "max_new_tokens": 2},
                      timeout=60).status_code == 200  # the state is kept


def test_a_steering_vector_whose_entries_overflow_float32_is_refused(llama):
    url, _, counter = llama
    vector = tensors_to_b64({"vector": torch.full((64,), 1e38)})
    _refused(url, counter, "/trace", {"text": "a b c", "interventions": [
        {"kind": "add", "site": "resid_post.0", "vector": vector}]}, "has an entry of magnitude 1e+38")


# ----- a stalled upload -----


def _length(head: bytes) -> int:
    for line in head.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_a_stalled_upload_gets_a_408_and_the_server_goes_on(llama):
    url, _, counter = llama
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as stalled:
        stalled.sendall(b"POST /trace HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"text\": ")
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = stalled.recv(65536)
            assert chunk, f"the server closed the connection after {answer!r}"
            answer += chunk
        answer = answer.decode("latin-1")
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "the request body stopped arriving after 9 bytes" in answer
    assert httpx.post(f"{url}/trace", json={"text": "2 + 2"}, timeout=60).status_code == 200


def _answer(conn: socket.socket) -> str:
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
        chunk = conn.recv(65536)
        assert chunk, f"the server closed the connection after {answer!r}"
        answer += chunk
    return answer.decode("latin-1")


@pytest.mark.parametrize("sent", [b"", b"POST /trace HTTP/1.1\r\nHost: x\r\nContent-Ty"])
def test_a_stalled_request_line_or_headers_get_a_408_and_the_connection_is_closed(llama, sent):
    """uvicorn times out neither: a client that connected and sent nothing, or stopped inside its headers
    (h11 buffers up to 16 KiB of them), held its connection for ever. Now the same deadline as a stalled
    body (`read_timeout_s`, 1 s here)."""
    url, _, counter = llama
    host, port = url.rsplit("/", 1)[1].split(":")
    before = counter.calls
    with socket.create_connection((host, int(port)), timeout=30) as stalled:
        stalled.sendall(sent)
        answer = _answer(stalled)
        assert stalled.recv(1) == b""  # closed after the answer
    assert answer.startswith("HTTP/1.1 408"), answer
    assert ('"error": "the request line and headers did not arrive within 1 s; send the whole request at once", '
            '"kind": "RequestTimeoutError"') in answer
    assert counter.calls == before
    assert httpx.post(f"{url}/trace", json={"text": "2 + 2"}, timeout=60).status_code == 200


def test_a_kept_alive_connection_that_stalls_in_its_next_headers_gets_a_408(llama):
    url, _, _ = llama
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(conn).startswith("HTTP/1.1 200")
        time.sleep(1.5)  # idle past the deadline between requests: that is keep-alive's (5 s), not a stall
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(conn).startswith("HTTP/1.1 200")
        conn.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _answer(conn).startswith("HTTP/1.1 408")

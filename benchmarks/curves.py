"""Growth curves (`thoughtscope bench curves`, or one area: `curves-capture`, `curves-sites`, `curves-stream`,
`curves-fork`, `curves-cusum`, `curves-batch`, `curves-server`, `curves-harvest`): how the cost of each hot
path grows with the work, against its expected shape.

Every curve measures its path at growing sizes beside a baseline of the same size (a plain HF forward, HF
`generate`, a forward from scratch, the same batch without interventions), prints a table (to stderr, so
`--json` output stays one JSON object per line), saves a plot with its data and provenance under
`docs/curves/` (the project's figure template, `app.figures.curves`), and returns one row per curve whose
`ratio` is the top point over the expected shape fitted to the points below it (non-negative least squares
on `1, n` for linear shapes and `1, n, n^2` where attention adds its quadratic term; a flat shape for the
server's throughput). `holds` is `ratio <= 1.3`. Peak memory is the resident-set growth during one run
(sampled every 2 ms after returning freed memory to the system; the GPU's peak allocation on CUDA).

Sizes: the default finishes in a few minutes on a 2-core CPU: the length curves run on a random
2-layer Llama with a 8,192-token context (`tiny-random:llama` with its positions extended: on this CPU
SmolLM2 at 4,096 tokens takes minutes per point), the sites and server curves on the `--model` given and
`tiny-random:llama`. `THOUGHTSCOPE_CURVES=full` runs every curve on `--model` (SmolLM2 by default) at the
sizes of issue 28 (128-4,096 tokens, 1-64 rows, 1-16 clients). Each row names the model it used.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probes.engine import Engine
from probes.timing import STORY, sig

LIMIT = 1.3
OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "curves"
LONG_TINY = "tiny-random:llama (8192 positions)"


def mode() -> str:
    """`THOUGHTSCOPE_CURVES`: "full" (the issue's sizes on --model), "model" (--model at sizes up to 1,024
    tokens), else the default (the long tiny model for the length curves)."""
    return os.environ.get("THOUGHTSCOPE_CURVES", "").strip().lower() or "default"


def full() -> bool:
    return mode() == "full"


def _sizes(sizes: list[int], cap: int = 1024) -> list[int]:
    return [n for n in sizes if n <= cap] if mode() == "model" else sizes


# ----- measuring -----


def _trim() -> None:
    """Hand freed heap pages back to the system, so a resident-set delta sees what the next run allocates."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), bytes of peak memory above the start): the GPU's peak allocation, else the RSS sampled every 2 ms."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, int(torch.cuda.max_memory_allocated() - start)
    import psutil

    proc = psutil.Process()
    _trim()
    start = proc.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        out = fn()
    finally:
        done.set()
        watcher.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    return out, int(peak[0] - start)


def timed(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each side, run in alternation after one warm-up each (a slow moment hits all sides)."""
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def shape_ratio(x: Sequence[float], y: Sequence[float], shape: str, higher_is_worse: bool = True) -> dict[str, Any]:
    """The top point against the expected shape fitted (non-negative least squares) to the points below it.

    `shape`: "linear" (a + b n), "quadratic" (a + b n + c n^2: attention's term) or "flat" (a).
    The ratio is measured / predicted (predicted / measured when lower is worse, e.g. throughput)."""
    from scipy.optimize import nnls

    powers = {"flat": 1, "linear": 2, "quadratic": 3}[shape]
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    scale = xs.max()
    basis = np.stack([(xs / scale) ** p for p in range(powers)], axis=1)
    coef, _ = nnls(basis[:-1], ys[:-1])
    predicted = float(basis[-1] @ coef)
    measured = float(ys[-1])
    ratio = measured / predicted if higher_is_worse else predicted / measured
    return {"shape": shape, "predicted_top": sig(predicted), "measured_top": sig(measured), "ratio": round(ratio, 3),
            "holds": bool(ratio <= LIMIT)}


# ----- the models -----


def long_tiny_engine(context: int = 8192) -> Engine:
    """`tiny-random:llama` with its positions extended to `context` (rotary positions are computed, not learned)."""
    from probes.zoo import load_model

    handle = load_model("tiny-random:llama", device="cpu")
    handle.model.config.max_position_embeddings = context
    handle.arch = dataclasses.replace(handle.arch, context_length=context)
    return Engine(handle)


def _engine_for(model_id: str, long: bool) -> tuple[Engine, str]:
    if long and mode() not in ("full", "model"):
        return long_tiny_engine(), LONG_TINY
    return Engine.from_id(model_id), model_id


def _ids(engine: Engine, n: int) -> list[int]:
    base = engine.encode(STORY)
    return (base * (n // len(base) + 1))[:n]


class _NoEos:
    """Generation runs to max_new_tokens (as HF generate's min_new_tokens does): EOS ends nothing while inside."""

    def __init__(self, engine: Engine):
        self.engine, self.saved = engine, engine._eos

    def __enter__(self) -> None:
        self.engine._eos = set()

    def __exit__(self, *exc: Any) -> None:
        self.engine._eos = self.saved


# ----- the curves: each returns (row, table rows, plot series) -----


def curve_capture_length(model_id: str) -> dict[str, Any]:
    engine, used = _engine_for(model_id, long=True)
    n_layers = engine.arch().n_layers
    sites = [f"resid_post.{n_layers // 2}", f"mlp_out.{n_layers // 2}", f"attn_out.{n_layers - 1}"]
    lengths = _sizes([128, 256, 512, 1024, 2048, 4096])
    table = []
    for n in lengths:
        ids = _ids(engine, n)
        x = torch.tensor([ids])

        @torch.no_grad()
        def plain() -> None:  # the same forward without hooks (a capture returns no logits: the last one only)
            engine.model(input_ids=x, use_cache=False, logits_to_keep=1)

        @torch.no_grad()
        def hf_all_logits() -> None:  # what `model(input_ids)` costs as HF users call it
            engine.model(input_ids=x, use_cache=False)

        def captured() -> None:
            engine.capture(ids, sites)

        t = timed({"plain": plain, "capture": captured, "hf": hf_all_logits}, repeats=3 if n <= 1024 else 2)
        _, m_plain = peak_memory(plain)
        _, m_cap = peak_memory(captured)
        _, m_hf = peak_memory(hf_all_logits)
        table.append({"tokens": n, "plain_s": sig(t["plain"]), "capture_s": sig(t["capture"]),
                      "hf_all_logits_s": sig(t["hf"]), "ratio": round(t["capture"] / t["plain"], 3),
                      "plain_peak_mb": round(m_plain / 2**20, 1), "capture_peak_mb": round(m_cap / 2**20, 1),
                      "hf_all_logits_peak_mb": round(m_hf / 2**20, 1)})
    return _finish("capture_length", used, "tokens", table, "capture_s", "quadratic", baseline="plain_s",
                   memory=("plain_peak_mb", "capture_peak_mb", "hf_all_logits_peak_mb"), memory_shape="linear",
                   extra_series=("hf_all_logits_s",),
                   note=f"3 sites ({', '.join(sites)}) vs the same forward without hooks (last logits) and a plain HF "
                        "forward with every position's logits")


def curve_capture_sites(model_id: str) -> dict[str, Any]:
    engine = Engine.from_id(model_id)
    n_layers = engine.arch().n_layers
    n = 1024 if full() else 256
    ids = _ids(engine, n)
    x = torch.tensor([ids])
    groups = [("1 site", [f"resid_post.{n_layers // 2}"]),
              ("3 sites", [f"resid_post.{n_layers // 2}", f"mlp_out.{n_layers // 2}", f"attn_out.{n_layers - 1}"]),
              ("all resid_post", [f"resid_post.{i}" for i in range(n_layers)]),
              ("all attn_pattern", [f"attn_pattern.{i}" for i in range(n_layers)])]

    @torch.no_grad()
    def plain() -> None:  # the same forward without hooks (a capture returns no logits: the last one only)
        engine.model(input_ids=x, use_cache=False, logits_to_keep=1)

    table = []
    for label, sites in groups:
        t = timed({"plain": plain, "capture": lambda: engine.capture(ids, sites)}, repeats=3)
        _, m_cap = peak_memory(lambda: engine.capture(ids, sites))
        table.append({"sites": len(sites), "what": label, "plain_s": sig(t["plain"]), "capture_s": sig(t["capture"]),
                      "ratio": round(t["capture"] / t["plain"], 3), "capture_peak_mb": round(m_cap / 2**20, 1)})
    # the shape is over the residual sites (1, 3, all); attention patterns switch to eager attention (reported)
    resid = table[:3]
    row = _finish("capture_sites", model_id, "sites", resid, "capture_s", "linear", baseline="plain_s",
                  memory=(None, "capture_peak_mb"), memory_shape="linear",
                  note=f"{n} tokens; attention patterns of every layer: ratio {table[3]['ratio']} to the plain "
                       f"forward, peak {table[3]['capture_peak_mb']} MB (eager attention; not on the fitted line)")
    row["table"] = table
    return row


def curve_stream_length(model_id: str) -> dict[str, Any]:
    engine, used = _engine_for(model_id, long=True)
    n_layers = engine.arch().n_layers
    prompt = _ids(engine, 32)
    one = [f"resid_post.{n_layers // 2}"]
    every = [f"resid_post.{i}" for i in range(n_layers)]
    x = torch.tensor([prompt])
    table = []
    for new in ([128, 256, 512, 1024, 2048] if full() or used == LONG_TINY else [128, 256, 512]):
        def hf() -> None:
            engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=engine.tok.pad_token_id)

        def stream(sites: list[str]) -> Callable[[], int]:
            def run() -> int:
                with _NoEos(engine):
                    return sum(1 for _ in engine.generate(prompt, max_new_tokens=new, capture=sites, top_k=5))
            return run

        t = timed({"hf": hf, "one": stream(one), "all": stream(every)}, repeats=1 if new >= 1024 else 2)
        _, m_hf = peak_memory(hf)
        _, m_all = peak_memory(stream(every))
        table.append({"new_tokens": new, "hf_s": sig(t["hf"]), "engine_1_site_s": sig(t["one"]),
                      "engine_all_sites_s": sig(t["all"]), "hf_tokens_per_s": sig(new / t["hf"]),
                      "engine_1_site_tokens_per_s": sig(new / t["one"]),
                      "engine_all_sites_tokens_per_s": sig(new / t["all"]),
                      "ratio": round(t["all"] / t["hf"], 3), "hf_peak_mb": round(m_hf / 2**20, 1),
                      "engine_all_sites_peak_mb": round(m_all / 2**20, 1)})
    return _finish("stream_length", used, "new_tokens", table, "engine_all_sites_s", "quadratic", baseline="hf_s",
                   memory=("hf_peak_mb", "engine_all_sites_peak_mb"), memory_shape="linear",
                   extra_series=("engine_1_site_s",),
                   note=f"32-token prompt; entropy, top-5 and 1 site / all {n_layers} resid_post sites, against HF "
                        "generate (greedy, min_new_tokens)")


def curve_fork_prefix(model_id: str) -> dict[str, Any]:
    engine, used = _engine_for(model_id, long=True)
    probe = _ids(engine, 16)
    table = []
    for n in _sizes([256, 512, 1024, 2048, 4096], cap=2048):
        prefix = _ids(engine, n)
        state = engine.prefill(prefix)
        x = torch.tensor([prefix + probe])

        @torch.no_grad()
        def scratch() -> None:
            engine.model(input_ids=x, use_cache=False, logits_to_keep=1)

        t = timed({"fork": lambda: engine.fork(state, probe, max_new_tokens=1), "scratch": scratch}, repeats=3)
        _, m_fork = peak_memory(lambda: engine.fork(state, probe, max_new_tokens=1))
        engine.free(state)
        table.append({"prefix_tokens": n, "fork_s": sig(t["fork"]), "scratch_s": sig(t["scratch"]),
                      "ratio": round(t["fork"] / t["scratch"], 3), "fork_peak_mb": round(m_fork / 2**20, 1)})
    return _finish("fork_prefix", used, "prefix_tokens", table, "fork_s", "linear", baseline="scratch_s",
                   memory=(None, "fork_peak_mb"), memory_shape="linear",
                   note="a 16-token probe forked from a prefix state (its queries read the prefix: linear) vs a "
                        "forward of prefix + probe from scratch (linear + quadratic)")


def curve_cusum_length(model_id: str) -> dict[str, Any]:
    from analyses.cot_entropy.detector import CalibrationTrace, CusumDetector, cusum_path, first_alarm
    from analyses.cot_entropy.probing import probe_positions
    from analyses.families import family_for

    engine, used = _engine_for(model_id, long=True)
    family = family_for(engine if used != LONG_TINY else "tiny-random:llama")
    rng = np.random.default_rng(0)
    detector = CusumDetector().fit([CalibrationTrace(list(rng.normal(1.0, 0.2, 4).clip(0)) +
                                                     list(rng.normal(0.3, 0.1, 4).clip(0)),
                                                     ["0"] * 4 + ["1"] * 4, "1") for _ in range(8)])
    prompt = _ids(engine, 32)
    every = 32
    table = []
    # a quadratic has three coefficients: at least three points below the top (model sizes stop at 512)
    sizes = [128, 256, 512, 1024, 2048, 4096] if full() else [128, 256, 512, 1024, 2048]
    for n in ([64, 128, 192, 256, 384, 512] if mode() == "model" else sizes):
        trace = _ids(engine, n)

        def run() -> int:
            probes = probe_positions(engine, prompt, trace, range(every, n + 1, every), family)
            z = np.atleast_1d(detector.log_likelihood_ratio([p.mean_entropy for p in probes.values()]))
            return int(first_alarm(cusum_path(z), detector.threshold) or 0)

        def prefill_only() -> None:
            engine.free(engine.prefill(prompt + trace))

        t = timed({"cusum": run, "prefill": prefill_only}, repeats=2)
        table.append({"trace_tokens": n, "probes": n // every, "cusum_s": sig(t["cusum"]),
                      "prefill_s": sig(t["prefill"]), "ratio": round(t["cusum"] / t["prefill"], 3),
                      "s_per_probe": sig(t["cusum"] / (n // every))})
    # the prefill of the whole trace is drawn for reference, not as the baseline: probes grow with the trace
    return _finish("cusum_length", used, "trace_tokens", table, "cusum_s", "quadratic", extra_series=("prefill_s",),
                   note=f"a probe every {every} tokens (one prefill, one fork per probe, the CUSUM update); probes "
                        "grow with the trace and each reads its prefix: linear + quadratic")


def curve_batch_rows(model_id: str) -> dict[str, Any]:
    from probes.edits import Additive

    engine, used = _engine_for(model_id, long=True)
    arch = engine.arch()
    site = f"resid_post.{arch.n_layers // 2}"
    vector = torch.randn(arch.d_model, generator=torch.Generator().manual_seed(0))
    prompt = _ids(engine, 32)
    new = 32
    table = []
    for rows in [1, 2, 4, 8, 16, 32, 64]:
        strengths = [0.1 * (b % 8) for b in range(rows)]

        def run(interventions: list[Any]) -> Callable[[], int]:
            def go() -> int:
                with _NoEos(engine):
                    return sum(1 for _ in engine.generate(prompts=[prompt] * rows, max_new_tokens=new, top_k=5,
                                                          interventions=interventions))
            return go

        steered = [Additive(site, vector, strength=strengths)]
        t = timed({"plain": run([]), "per_row": run(steered)}, repeats=2)
        _, m = peak_memory(run(steered))
        table.append({"rows": rows, "plain_s": sig(t["plain"]), "per_row_s": sig(t["per_row"]),
                      "ratio": round(t["per_row"] / t["plain"], 3), "tokens_per_s": sig(rows * new / t["per_row"]),
                      "per_row_peak_mb": round(m / 2**20, 1)})
    return _finish("batch_rows", used, "rows", table, "per_row_s", "linear", baseline="plain_s",
                   memory=(None, "per_row_peak_mb"), memory_shape="linear",
                   note=f"{new} new tokens per row, an additive steering term with a different strength per row "
                        "vs the same batch without it")


def client_load(url: str, clients: int, per_client: int) -> dict[str, Any]:
    """`clients` concurrent clients, each sending `per_client` requests one after another, alternating a
    16-token stream and a trace (every size has the same mix); per-request latencies and the wall time.

    Runs in its own process (`curve_server_clients`), as one asyncio loop: client threads in the benchmark's
    process shared its interpreter and cores with the measurement and took CPU from the server as they grew."""
    import asyncio

    import httpx

    async def client(http: httpx.AsyncClient, i: int) -> list[float]:
        out = []
        for k in range(per_client):
            stream = (i + k) % 2 == 1
            t0 = time.perf_counter()
            r = await http.post("/generate" if stream else "/trace",
                                json={"prompt": STORY, "max_new_tokens": 16} if stream else {"text": STORY})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
        return out

    async def run() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            t0 = time.perf_counter()
            latencies = await asyncio.gather(*(client(http, i) for i in range(clients)))
            return {"latencies": [x for xs in latencies for x in xs], "wall": time.perf_counter() - t0}

    return asyncio.run(run())


def curve_server_clients(model_id: str) -> dict[str, Any]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from probes.server_bench import free_port, start_server, stop_server, wait_ready

    used = model_id if full() else "tiny-random:llama"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(used, port, extra="max_queue=32", device="cpu", torch_threads=1)
    per_client = 8
    table = []
    try:
        wait_ready(proc, url)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as driver:
            driver.submit(client_load, url, 2, per_client).result()  # warm-up: the driver process and the server
            for clients in [1, 2, 4, 8, 16]:
                load = driver.submit(client_load, url, clients, per_client).result()
                table.append({"clients": clients, "requests": clients * per_client,
                              "throughput_per_s": sig(clients * per_client / load["wall"]),
                              "p95_s": sig(float(np.percentile(load["latencies"], 95))),
                              "median_s": sig(float(np.median(load["latencies"]))), "wall_s": sig(load["wall"])})
    finally:
        stop_server(proc)
    row = _finish("server_clients", used, "clients", table, "p95_s", "linear",
                  note=f"{per_client} requests per client, each client alternating 16-token streams and traces, "
                       "driven from one asyncio process beside the server; one model call at a time, so p95 "
                       "grows linearly and throughput stays flat")
    flat = shape_ratio([r["clients"] for r in table], [r["throughput_per_s"] for r in table], "flat",
                       higher_is_worse=False)
    row["throughput_shape"] = flat
    row["holds"] = row["holds"] and flat["holds"]
    return row


def curve_harvest(model_id: str) -> dict[str, Any]:
    from analyses.fuzzy_concepts.harvest import TextSource, harvest
    from analyses.rise.harvest import step_residuals

    engine, used = _engine_for(model_id, long=True)
    layer = engine.arch().n_layers // 2
    base = _ids(engine, 64)
    table = []
    for n in [4, 8, 16, 32, 64]:
        sequences = [base[:48] + base[(i % 16):(i % 16) + 16] for i in range(n)]
        positions = [[50, 56, 63] for _ in range(n)]
        texts = tuple(f"Sample {i}: the dragon counted {i} coins and then {i + 1} more." for i in range(n))

        def rise() -> None:
            step_residuals(engine, sequences, positions, [layer])

        def fuzzy() -> None:
            harvest(engine, TextSource("dragon", kind="texts", texts=texts, n=n, where="any"), layer)

        t = timed({"rise": rise, "fuzzy": fuzzy}, repeats=2)
        table.append({"traces": n, "rise_s": sig(t["rise"]), "fuzzy_s": sig(t["fuzzy"]),
                      "rise_s_per_trace": sig(t["rise"] / n), "fuzzy_s_per_trace": sig(t["fuzzy"] / n)})
    row = _finish("harvest", used, "traces", table, "rise_s", "linear", extra_series=("fuzzy_s",),
                  note="RISE step vectors (64-token traces, a shared 48-token prefix, 3 positions each) and fuzzy "
                       "representations (one text per sample) against the number of traces")
    fuzzy_shape = shape_ratio([r["traces"] for r in table], [r["fuzzy_s"] for r in table], "linear")
    row["fuzzy_shape"] = fuzzy_shape
    row["holds"] = row["holds"] and fuzzy_shape["holds"]
    return row


# ----- tables, plots, rows -----


def _finish(name: str, model: str, x_key: str, table: list[dict[str, Any]], y_key: str, shape: str, *,
            baseline: str | None = None, memory: tuple[str | None, ...] | None = None, memory_shape: str = "linear",
            extra_series: Sequence[str] = (), note: str = "") -> dict[str, Any]:
    xs = [r[x_key] for r in table]
    check = shape_ratio(xs, [r[y_key] for r in table], shape)
    row: dict[str, Any] = {"bench": f"curve_{name}", "ratio": check["ratio"], "target": LIMIT, "holds": check["holds"],
                           "shape": shape, "model": model, "sizes": mode(), "note": note,
                           "fit": check, "table": table}
    if baseline is not None:
        base_check = shape_ratio(xs, [r[baseline] for r in table], shape)
        row["baseline_fit"] = base_check
        row["overhead_growth"] = round((table[-1][y_key] / table[-1][baseline]) /
                                       (table[0][y_key] / table[0][baseline]), 3)
    if memory is not None:
        mem = shape_ratio(xs, [max(r[memory[1]], 0.1) for r in table], memory_shape)
        row["memory_fit"] = mem
    row["plot"] = _plot(name, model, x_key, table, y_key, shape, check, baseline, memory, extra_series, note)
    _print_table(name, model, table, check)
    return row


def _plot(name: str, model: str, x_key: str, table: list[dict[str, Any]], y_key: str, shape: str,
          check: dict[str, Any], baseline: str | None, memory: tuple[str | None, ...] | None,
          extra_series: Sequence[str], note: str) -> str:
    from app.export import save_figure
    from app.figures.curves import curve_figure
    from thoughtscope.provenance import provenance

    device = "cuda" if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads"
    series = {y_key: [r[y_key] for r in table]}
    for key in (baseline, *extra_series):
        if key:
            series[key] = [r[key] for r in table]
    data = {"name": name, "model": model, "x_label": x_key.replace("_", " "), "x": [r[x_key] for r in table],
            "series": series, "shape": shape, "fit": check, "note": note,
            "memory": ({k: [r[k] for r in table] for k in memory if k} if memory else {}), "machine": machine()}
    record = provenance({"model_id": model}, data="synthetic (probes.timing.STORY tokens)",
                        settings={"curve": name, "sizes": mode(), "device": device},
                        command=f"thoughtscope bench curves-{name.split('_')[0]}")
    fig = curve_figure(data)
    formats = ["png", "json"]
    name = name if mode() == "default" else f"{name}_{mode()}"  # the default run's files are kept
    try:
        written = save_figure(fig, data, name, OUT_DIR, formats, figure="growth_curve", provenance=record)
    except Exception as err:  # no Chromium for the PNG: keep the data
        print(f"curves: PNG of {name} not written ({err}); data only", file=sys.stderr)
        written = save_figure(fig, data, name, OUT_DIR, ["json"], figure="growth_curve", provenance=record)
    return str(written[0].relative_to(OUT_DIR.parents[1]))


def machine() -> str:
    import platform

    import psutil

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{psutil.cpu_count(logical=True)}-core {platform.machine()} CPU, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {gpu}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch threads, load {os.getloadavg()[0]:.1f}")


def _print_table(name: str, model: str, table: list[dict[str, Any]], check: dict[str, Any]) -> None:
    keys = list(table[0])
    print(f"\n{name} on {model}: expected {check['shape']}; top point {check['measured_top']} vs shape "
          f"{check['predicted_top']}: ratio {check['ratio']} ({'holds' if check['holds'] else 'DOES NOT HOLD'})",
          file=sys.stderr)
    print(" | ".join(keys), file=sys.stderr)
    for r in table:
        print(" | ".join(str(r[k]) for k in keys), file=sys.stderr)


AREAS: dict[str, list[Callable[[str], dict[str, Any]]]] = {
    "capture": [curve_capture_length],
    "sites": [curve_capture_sites],
    "stream": [curve_stream_length],
    "fork": [curve_fork_prefix],
    "cusum": [curve_cusum_length],
    "batch": [curve_batch_rows],
    "server": [curve_server_clients],
    "harvest": [curve_harvest],
}


def _group(curves: list[Callable[[str], dict[str, Any]]]) -> Callable[[str], Iterator[dict[str, Any]]]:
    def run(model_id: str = "smollm2-135m") -> Iterator[dict[str, Any]]:
        """Each curve's row as soon as it is measured (a later curve's failure keeps the earlier ones printed)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if not torch.cuda.is_available() else threads)
        try:
            for curve in curves:
                yield curve(model_id)
        finally:
            torch.set_num_threads(threads)
    return run


BENCHMARKS = {"curves": _group([c for cs in AREAS.values() for c in cs]),
              **{f"curves-{area}": _group(cs) for area, cs in AREAS.items()}}

def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The curves' rows (`thoughtscope bench curves --json` output) as Markdown: per curve its verdict and table."""
    out = []
    for row in rows:
        fit = row["fit"]
        verdict = "holds" if row["holds"] else "**does not hold**"
        out.append(f"### {row['bench'].removeprefix('curve_').replace('_', ' ')}\n")
        out.append(f"Model: `{row['model']}`; {row.get('note', '')}. Expected shape: {row['shape']}; top point "
                   f"{fit['measured_top']} against {fit['predicted_top']} extrapolated from the points below it: "
                   f"ratio **{fit['ratio']}** ({verdict} at {LIMIT}).")
        extra = []
        if "baseline_fit" in row:
            extra.append(f"baseline's own top / shape {row['baseline_fit']['ratio']}; overhead over the baseline "
                         f"at the top / at the bottom {row['overhead_growth']}")
        if "memory_fit" in row:
            extra.append(f"peak memory top / {row['memory_fit']['shape']} shape {row['memory_fit']['ratio']}")
        for key in ("throughput_shape", "fuzzy_shape"):
            if key in row:
                extra.append(f"{key.replace('_', ' ')}: {row[key]['shape']}, ratio {row[key]['ratio']} "
                             f"({'holds' if row[key]['holds'] else 'does not hold'})")
        if extra:
            out.append(" " + "; ".join(extra) + ".")
        keys = list(row["table"][0])
        out.append("\n\n| " + " | ".join(k.replace("_", " ") for k in keys) + " |")
        out.append("|" + "---|" * len(keys))
        out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in row["table"]]
        out.append(f"\n![{row['bench']}]({Path(row['plot']).relative_to('docs').as_posix()})\n")
    return "\n".join(out)


if __name__ == "__main__":  # python -m benchmarks.curves [AREA ...] | --markdown ROWS.jsonl ...
    import json

    if sys.argv[1:2] == ["--markdown"]:
        rows = [json.loads(line) for name in sys.argv[2:] for line in Path(name).read_text().splitlines()
                if line.startswith("{")]
        print(markdown(rows))
    else:
        for area in sys.argv[1:] or ["all"]:
            for row in BENCHMARKS["curves" if area == "all" else f"curves-{area}"]("smollm2-135m"):
                print(json.dumps(row), flush=True)

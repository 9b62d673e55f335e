"""The corpus feature browser: corpora, the stored index, browsing an SAE latent / neuron / vector (checked
against a direct computation, in-process and through the model server), and its page."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests import apptest_helpers as helpers  # noqa: E402

from analyses.feature_browser import (CORPORA, IndexSettings, Neuron, SAELatent, VectorDirection, browse,  # noqa: E402
                                      build_index, load_corpus, text_corpus, tokenize_corpus)
from thoughtscope.errors import BadInputError  # noqa: E402

MODEL = "tiny-random:llama"
SITE = "resid_post.1"
EXACT = IndexSettings(max_tokens=24, batch_size=8, dtype="float32", chunk_size=16)


@pytest.fixture(scope="module")
def engine():
    from probes import Engine

    return Engine.from_id(MODEL)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("gsm8k-questions", n=20)


@pytest.fixture(scope="module")
def index(engine, corpus):
    return build_index(engine, corpus, SITE, EXACT, store=None)


@pytest.fixture(scope="module")
def sae():
    from saes.train import SAETrainSettings, train_sae

    sae, _ = train_sae(torch.randn(512, 64), SAETrainSettings(d_sae=32, batch_size=64, steps=20, progress=False))
    return sae


def direct_top(engine, corpus, direction, k, positive_only=False):
    """The reference: each context through the model on its own, scored token by token (first token left out)."""
    scored = []
    for c, ids in enumerate(tokenize_corpus(engine, corpus, EXACT.max_tokens)):
        acts = engine.capture(ids, [SITE])[SITE][1:]
        scored.append((float(direction.scores(acts).max()), c))
    scored.sort(key=lambda x: (-x[0], x[1]))
    return [(c, m) for m, c in scored[:k] if not positive_only or m > 0]


# ----------------------------------------------------------------- corpora

def test_shipped_and_user_corpora():
    assert set(CORPORA) == {"gsm8k-questions", "gsm8k-solutions", "gsm8k-sentences", "arith-problems"}
    sentences = load_corpus("gsm8k-sentences")
    assert len(sentences.texts) > 9000 and sentences.split == "test"  # about 10k contexts from 1,319 problems
    solutions = load_corpus("gsm8k-solutions", n=2)
    assert "<<" not in solutions.texts[0] and "####" not in solutions.texts[0]  # no calculator marks, no answer tag
    assert len(load_corpus("arith-problems", n=30).texts) == 30
    mine = text_corpus("First paragraph.\n\nSecond\nparagraph.\n\n\n", "mine.txt")
    assert mine.texts == ("First paragraph.", "Second\nparagraph.") and mine.key != load_corpus("gsm8k-questions", 2).key
    assert text_corpus("a\nb", unit="line").texts == ("a", "b")
    with pytest.raises(BadInputError, match="holds no text"):
        text_corpus("  \n\n ")
    with pytest.raises(BadInputError, match="unknown corpus"):
        load_corpus("wikipedia")


def test_long_texts_are_cut_into_windows(engine):
    long = text_corpus(" ".join(["seven"] * 100), "long")
    windows = tokenize_corpus(engine, long, 16)
    assert [len(w) for w in windows[:-1]] == [16] * (len(windows) - 1)
    assert sum(map(len, windows)) == len(engine.encode(long.texts[0]))



def test_a_text_past_the_models_context_is_named_with_how_to_cut_it(engine):
    """One long paragraph (a pasted article without blank lines) said only "the prompt has N tokens; ...:
    shorten it" (the fuzzing pass of 2026-12-07): which text, and that blank lines or lines cut it, were left
    for the user to guess."""
    context = engine.arch().context_length
    mine = text_corpus("A short one.\n\n" + " ".join(["seven"] * (context + 10)), "article.txt")
    with pytest.raises(BadInputError) as refused:
        tokenize_corpus(engine, mine, 16)
    message = str(refused.value)
    assert message.startswith(f"text 2 of 'article.txt' ({len(mine.texts[1]):,} characters): the prompt has ")
    assert message.endswith("split it with blank lines (one context per paragraph) or take one context per line")
    lines = text_corpus("\n".join(["seven seven"] * (context + 10)), "article.txt", unit="line")  # the way out
    assert [len(w) for w in tokenize_corpus(engine, lines, 16)] == [2] * (context + 10)


# ----------------------------------------------------------------- the same top contexts as a direct computation

def test_a_neuron_and_a_vector_top_the_same_contexts_as_a_direct_computation(engine, corpus, index):
    for direction in (Neuron(5, SITE), VectorDirection(torch.randn(64, generator=torch.Generator().manual_seed(0)),
                                                       SITE, "concept")):
        view = browse(index, direction, engine, k=5)
        direct = direct_top(engine, corpus, direction, 5)
        assert [c["context"] for c in view.contexts] == [c for c, _ in direct]
        assert [c["max_activation"] for c in view.contexts] == pytest.approx([m for _, m in direct], abs=1e-4)
        top = view.contexts[0]
        assert top["activations"][0] is None and len(top["activations"]) == len(top["tokens"])
        assert top["activations"][top["max_position"]] == pytest.approx(top["max_activation"])
        assert "".join(top["tokens"]) == engine.decode(top["token_ids"])
        assert sum(view.histogram_counts) == view.n_tokens and view.histogram_of == "all tokens"


def test_an_sae_latent_tops_the_same_contexts_and_writes_its_decoder_row(engine, corpus, index, sae):
    latent = SAELatent(sae, 3, SITE)
    x = index.acts[:50]
    assert torch.allclose(latent.scores(x), sae.encode(x)[:, 3], atol=1e-5)  # one column = the SAE's own encode
    view = browse(index, latent, engine, k=4, n_logits=5)
    direct = direct_top(engine, corpus, latent, 4, positive_only=True)
    assert [c["context"] for c in view.contexts] == [c for c, _ in direct]
    assert [c["max_activation"] for c in view.contexts] == pytest.approx([m for _, m in direct], abs=1e-4)
    logits = engine.readout(sae.W_dec[3].detach().view(1, -1), norm=False, top_k=5, bottom_k=5)
    assert [w["token_id"] for w in view.promoted] == logits.top_ids[0].tolist()
    assert [w["token_id"] for w in view.suppressed] == logits.bottom_ids[0].tolist()
    assert sum(view.histogram_counts) == round(view.density * view.n_tokens)  # active tokens only
    with pytest.raises(BadInputError, match="latent 99 out of range"):
        browse(index, SAELatent(sae, 99, SITE), engine)
    with pytest.raises(BadInputError, match="indexed at"):
        browse(index, Neuron(0, "resid_post.0"), engine)


def test_a_topk_sae_runs_its_whole_encoder(engine, index):
    from saes.train import SAETrainSettings, train_sae

    topk, _ = train_sae(torch.randn(256, 64), SAETrainSettings(architecture="topk", d_sae=32, k=4, batch_size=64,
                                                                steps=10, progress=False))
    latent = SAELatent(topk, 2, SITE)
    assert latent.architecture == "topk"
    assert torch.allclose(latent.scores(index.acts[:40]), topk.encode(index.acts[:40])[:, 2], atol=1e-6)


def test_float16_storage_keeps_the_ranking(engine, corpus, index):
    small = build_index(engine, corpus, SITE, IndexSettings(max_tokens=24, batch_size=8), store=None)
    assert small.acts.dtype == torch.float16 and small.nbytes * 2 == index.nbytes
    direction = Neuron(7, SITE)
    exact, half = browse(index, direction, k=5), browse(small, direction, k=5)
    assert [c["max_activation"] for c in half.contexts] == pytest.approx(
        [c["max_activation"] for c in exact.contexts], rel=2e-3, abs=1e-3)


def test_the_index_is_computed_once_into_the_cache(engine, corpus, tmp_path):
    from cache.store import ActivationStore

    store = ActivationStore(tmp_path / "store")
    calls, ticks = [], []

    class Counting:
        def __getattr__(self, name):
            return getattr(engine, name)

        def capture_batch(self, *args, **kwargs):
            calls.append(len(args[0]))
            return engine.capture_batch(*args, **kwargs)

    first = build_index(Counting(), corpus, SITE, EXACT, store=store, on_progress=lambda d, t: ticks.append((d, t)))
    assert sum(calls) == first.n_contexts and ticks[-1] == (first.n_contexts, first.n_contexts)
    assert len(store.list()) == -(-first.n_contexts // EXACT.chunk_size)  # one entry per chunk
    calls.clear()
    again = build_index(Counting(), corpus, SITE, EXACT, store=store)
    assert calls == [] and torch.equal(again.acts, first.acts) and torch.equal(again.ids, first.ids)


# ----------------------------------------------------------------- through the model server

@pytest.fixture(scope="module")
def model_server(tiny_server_url):
    """`thoughtscope serve --model tiny-random:llama` on a free loopback port: the session's (tests/conftest.py)."""
    return tiny_server_url


def test_browsing_through_the_model_server_matches_in_process(model_server, engine, corpus, index):
    from probes.client import RemoteBackend

    remote = RemoteBackend(model_server)
    served = build_index(remote, corpus, SITE, EXACT, store=None)
    assert torch.allclose(served.acts, index.acts, atol=1e-5)
    direction = Neuron(5, SITE)
    here, there = browse(index, direction, engine, k=5), browse(served, direction, remote, k=5)
    assert [c["context"] for c in there.contexts] == [c["context"] for c in here.contexts]
    assert there.promoted == here.promoted


# ----------------------------------------------------------------- the page

def test_the_page_indexes_then_browses_a_neuron_and_an_sae_latent(monkeypatch, tmp_path, sae):
    from saes.io import save_sae

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", MODEL)
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_sae(sae, tmp_path / "cache" / "rise" / "run0" / SITE)
    (folder / "rise.json").write_text(json.dumps({"model_id": MODEL, "site": SITE}))  # what a RISE run records
    at = helpers.open_page("feature_browser")
    at.number_input(key="fb_n").set_value(12).run()
    assert "Index the corpus" in at.info[0].value
    at.button(key="fb_index").click().run()  # a job: progress, time left, Stop
    helpers.assert_clean(at)
    from app import jobs

    deadline = time.monotonic() + 300
    while jobs.registry().running() and time.monotonic() < deadline:
        time.sleep(0.1)
    at.run()
    helpers.assert_clean(at)
    at.radio(key="fb_kind").set_value("neuron").run()
    at.number_input(key="fb_neuron").set_value(5).run()
    helpers.assert_clean(at)
    n = int(helpers.metric(at, "Contexts").replace(",", ""))
    assert n >= 12  # 12 questions, the long ones cut into windows
    html = at.html[0].proto.body
    assert html.count('class="fb-row"') == min(20, n) and "fb-top" in html  # the top contexts, top token outlined
    titles = " ".join(helpers.chart_titles(at))
    assert "Top contexts of neuron 5" in titles and "Activation histogram" in titles and "Logits" in titles
    at.radio(key="fb_kind").set_value("SAE latent").run()
    assert f"{MODEL} {SITE} d_sae=32" in at.selectbox(key="fb_sae_pick").options[0]  # the saved SAE is offered
    at.number_input(key="fb_latent").set_value(3).run()
    helpers.assert_clean(at)
    assert "SAE latent 3" in " ".join(helpers.chart_titles(at))
    at.button(key="fb_add_to_stack").click().run()  # the latent goes into the Steering page's stack, by reference
    from app.steering_stack_ui import STACK

    term = at.session_state[STACK]["stack"].terms[-1]
    assert (term.site, term.source["kind"], term.source["latent"]) == (SITE, "sae", 3)
    assert torch.equal(term.direction, sae.W_dec[3].detach().float())


def test_the_command_line_browses_with_provenance(monkeypatch, tmp_path):
    import typer
    from typer.testing import CliRunner

    from analyses.feature_browser.cli import register

    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path))
    cli = typer.Typer()
    register(cli)
    notes = tmp_path / "notes.txt"
    notes.write_text("Anna has 17 shells.\n\nShe wins 3 more shells today.\n\nHow many now?")
    result = CliRunner().invoke(cli, ["features", "top", "--model", MODEL, "--site", SITE, "--corpus", str(notes),
                                      "--neuron", "3", "--k", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["contexts"]) == 2 and out["corpus"]["name"] == "notes.txt"
    assert out["provenance"]["model"] == MODEL and out["provenance"]["settings"]["direction"]["index"] == 3
    bad = CliRunner().invoke(cli, ["features", "top", "--model", MODEL, "--site", SITE, "--neuron", "1", "--sae", "x"])
    assert bad.exit_code != 0 and "exactly one direction" in str(bad.exception)


def test_the_command_line_refuses_a_wrong_neuron_or_width_before_it_runs_the_corpus(monkeypatch, tmp_path):
    import typer
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from analyses.feature_browser import cli as fb_cli
    from probes import Engine

    d_model = Engine.from_id(MODEL).arch().d_model
    ran = []
    monkeypatch.setattr(fb_cli, "build_index", lambda *a, **k: ran.append(a))  # the corpus pass, counted
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path))
    cli = typer.Typer()
    fb_cli.register(cli)
    vector = tmp_path / "v.safetensors"
    save_file({"v": torch.ones(d_model + 1)}, str(vector))
    base = ["features", "top", "--model", MODEL, "--site", SITE, "--corpus", "gsm8k-questions", "--n", "4"]
    neuron = CliRunner().invoke(cli, [*base, "--neuron", str(d_model)])
    assert isinstance(neuron.exception, BadInputError)
    assert f"neuron {d_model} out of range" in str(neuron.exception) and f"0..{d_model - 1}" in str(neuron.exception)
    wide = CliRunner().invoke(cli, [*base, "--vector", str(vector)])
    assert isinstance(wide.exception, BadInputError)
    assert f"width {d_model + 1} but {SITE} has width {d_model}" in str(wide.exception)
    site = CliRunner().invoke(cli, [*base[:5], "resid_post.99", *base[6:], "--neuron", "0"])
    assert "layer 99 is out of range" in str(site.exception)
    assert ran == []  # all three refused before the corpus went through the model

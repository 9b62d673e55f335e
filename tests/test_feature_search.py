"""Latent labels, text search and per-token latents (issue 25 items 1-3), on tiny-random:llama.

The planted SAE reads `resid_pre.0` (the token embeddings: the same row for every occurrence of a
token, RoPE acts inside attention), so a latent whose encoder row is a token's unit embedding and
whose bias is -0.9 |e_t| fires on that token and, in these random 64-wide embeddings, on no other.
"""

from __future__ import annotations

import json

import pytest
import torch

from analyses.feature_browser import build_index, load_corpus
from analyses.feature_browser.labels import LABELS_FILE, build_labels, labels_for, row_tokens
from analyses.feature_browser.search import LabelSearch
from analyses.feature_browser.token_latents import trace_latents
from thoughtscope.errors import BadInputError

SITE = "resid_pre.0"
D_SAE = 16
PLANTED = {3: " many", 7: " she", 11: " much"}  # latent: the token it is planted on


def _sae(seed: int = 0, model_name: str | None = None):
    from sae_lens import StandardSAE, StandardSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    g = torch.Generator().manual_seed(seed)
    meta = SAEMetadata(model_name=model_name) if model_name else SAEMetadata()
    sae = StandardSAE(StandardSAEConfig(d_in=64, d_sae=D_SAE, dtype="float32", device="cpu", metadata=meta))
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(64, D_SAE, generator=g) * 0.3)
        sae.b_enc.copy_(torch.zeros(D_SAE))
        sae.W_dec.copy_(torch.randn(D_SAE, 64, generator=g))
        sae.b_dec.zero_()
    return sae


@pytest.fixture(scope="module")
def index(llama):
    return build_index(llama, load_corpus("gsm8k-questions", n=24), SITE, store=None)


@pytest.fixture(scope="module")
def planted(llama, index):
    sae = _sae()
    tokens = row_tokens(index)
    with torch.no_grad():
        for j, text in PLANTED.items():
            (token_id,) = llama.encode(text, add_special_tokens=False)
            e = index.acts[tokens == token_id][0].float()
            sae.W_enc[:, j] = e / e.norm()
            sae.b_enc[j] = -0.9 * e.norm()
    return sae


def test_planted_latents_are_labelled_with_their_token(llama, index, planted):
    labels = build_labels(index, planted, llama)
    tokens = row_tokens(index)
    for j, text in PLANTED.items():
        lab = labels.labels[j]
        (token_id,) = llama.encode(text, add_special_tokens=False)
        assert lab.top_tokens == [[text, int((tokens == token_id).sum())]]  # that token only, every time
        assert lab.n_active == int((tokens == token_id).sum())
        assert all(f"\u00ab{text}\u00bb" in c for c in lab.contexts)
    # decoder words: the readout of the decoder row without the final norm
    read = llama.readout(planted.W_dec[3:4].detach(), norm=False, top_k=8)
    assert labels.labels[3].output_words == llama.token_texts(read.top_ids[0].tolist())


def test_search_ranks_the_planted_latent_first(llama, index, planted):
    search = LabelSearch(build_labels(index, planted, llama))
    for j, text in PLANTED.items():
        assert search.search(text.strip())[0].latent == j


def test_dead_and_weak_latents_say_so(llama, index):
    sae = _sae()
    with torch.no_grad():
        sae.b_enc[0] = -1e4  # never fires
    labels = build_labels(index, sae, llama)
    assert labels.labels[0].quality == "dead" and labels.labels[0].summary.startswith("dead")
    assert labels.counts()["dead"] >= 1
    assert 0 not in [hit.latent for hit in LabelSearch(labels).search("the", k=D_SAE)]


def test_labels_are_kept_beside_the_sae_and_rebuilt_when_it_changes(llama, index, planted, tmp_path):
    from saes.io import save_sae

    save_sae(planted, tmp_path)
    first = labels_for(tmp_path, planted, index, llama)
    stored = json.loads((tmp_path / LABELS_FILE).read_text())
    assert stored["key"]["sae_sha256"] == first.key["sae_sha256"]
    assert labels_for(tmp_path, planted, index, llama).to_dict() == first.to_dict()  # read back
    other = _sae(seed=1)
    again = labels_for(tmp_path, other, index, llama)
    assert again.key["sae_sha256"] != first.key["sae_sha256"]
    assert json.loads((tmp_path / LABELS_FILE).read_text())["key"] == again.key


@pytest.mark.parametrize("query", ["", "   ", "x" * 10_000])
def test_bad_queries_are_clear_errors(llama, index, planted, query):
    search = LabelSearch(build_labels(index, planted, llama))
    with pytest.raises(BadInputError, match="query|search for"):
        search.search(query)


def test_token_latents_equal_a_direct_encode(llama, planted):
    text = "How many apples does she have?"
    ids = llama.encode(text)
    found = trace_latents(llama, ids, planted, "resid_post.1")
    direct = planted.encode(llama.capture(text, ["resid_post.1"])["resid_post.1"].float()).detach()
    for p in range(len(ids)):
        row = direct[p]
        want = sorted(((float(row[j]), j) for j in range(D_SAE) if row[j] > 0), key=lambda t: (-t[0], t[1]))
        got = found.at_token(p, k=D_SAE)
        assert [g["latent"] for g in got] == [j for _, j in want]
        assert [g["activation"] for g in got] == pytest.approx([v for v, _ in want], abs=1e-5)
    top = found.top_of_trace(k=3)
    assert [t["latent"] for t in top] == torch.argsort(direct[1:].max(0).values, descending=True)[:3].tolist()


def test_token_latents_refuse_an_sae_of_another_model_or_width(llama, planted):
    ids = llama.encode("hello")
    with pytest.raises(BadInputError, match="trained on"):
        trace_latents(llama, ids, _sae(model_name="smollm2-135m"), "resid_post.1")
    from sae_lens import StandardSAE, StandardSAEConfig

    narrow = StandardSAE(StandardSAEConfig(d_in=32, d_sae=4, dtype="float32", device="cpu"))
    with pytest.raises(BadInputError, match="width"):
        trace_latents(llama, ids, narrow, "resid_post.1")
    with pytest.raises(BadInputError, match="out of range"):
        trace_latents(llama, ids, planted, "resid_post.1").at_token(99)


def test_labels_and_token_latents_through_the_server_equal_in_process(llama, index, planted):
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    ids = llama.encode("How many apples does she have?")
    here = trace_latents(llama, ids, planted, "resid_post.1")
    with serving_in_thread(create_app(llama)) as url, RemoteBackend(url, timeout=30) as remote:
        there = trace_latents(remote, ids, planted, "resid_post.1")
        remote_index = build_index(remote, load_corpus("gsm8k-questions", n=24), SITE, store=None)
        remote_labels = build_labels(remote_index, planted, remote)
    assert torch.allclose(there.acts, here.acts, atol=1e-5) and there.tokens == here.tokens
    assert [lab.top_tokens for lab in remote_labels.labels] == [lab.top_tokens for lab in
                                                                build_labels(index, planted, llama).labels]
    assert remote_labels.labels[3].output_words == build_labels(index, planted, llama).labels[3].output_words


def test_the_feature_browser_page_searches_latents_and_opens_the_match(monkeypatch, tmp_path, llama, planted):
    """Search box on the page: the planted latent's token finds it first, and choosing it browses it."""
    import json as _json

    from saes.io import save_sae
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "tiny-random:llama")
    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_sae(planted, tmp_path / "cache" / "rise" / "run0" / SITE)
    (folder / "rise.json").write_text(_json.dumps({"model_id": "tiny-random:llama", "site": SITE}))
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_string("from app.main import main\nmain(only='feature_browser')\n", default_timeout=180)
    at.session_state["max_new_tokens"] = 8
    at.query_params["site"], at.query_params["latent"] = SITE, "3"  # a link from a search hit or the trace explorer
    at.run()
    assert (at.selectbox(key="fb_site_kind").value, at.selectbox(key="fb_layer").value) == ("resid_pre", 0)
    at.number_input(key="fb_n").set_value(24).run()
    at.button(key="fb_index").click().run()
    at = helpers.finish_jobs(at)
    at.radio(key="fb_kind").set_value("SAE latent").run()
    helpers.assert_clean(at)
    assert at.number_input(key="fb_latent").value == 3 and "SAE latent 3" in " ".join(helpers.chart_titles(at))
    at.text_input(key="fb_query").input("she").run()
    at.button(key="fb_label").click().run()  # labelling every latent is a job, once per SAE and corpus
    at = helpers.finish_jobs(at)
    helpers.assert_clean(at)
    assert at.radio(key="fb_hit").value == 7  # PLANTED[7] == " she"
    assert "SAE latent 7" in " ".join(helpers.chart_titles(at))
    at.text_input(key="fb_query").input("x" * 600).run()  # over the box's limit: refused, the page goes on
    assert not at.exception


@pytest.mark.model
@pytest.mark.parametrize("latent", ["99999999", "-1", "3.5"])
def test_a_link_to_a_latent_past_the_boxs_range_opens_on_latent_0(monkeypatch, latent):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "smollm2-135m")  # a shipped SAE and index: the latent box is drawn
    at = AppTest.from_string("from app.main import main\nmain(only='feature_browser')\n", default_timeout=180)
    at.query_params["latent"] = latent
    at.run()
    at.radio(key="fb_kind").set_value("SAE latent").run()
    assert not at.exception, [e.value for e in at.exception]  # 99999999 stopped the page with a traceback
    assert at.number_input(key="fb_latent").value == 0


def test_labels_refuse_an_sae_of_another_model(llama, index):
    with pytest.raises(BadInputError, match="trained on smollm2-135m"):
        build_labels(index, _sae(model_name="smollm2-135m"), llama)


def test_the_command_line_searches_labels_with_provenance(monkeypatch, tmp_path, planted):
    import json as _json

    import typer
    from typer.testing import CliRunner

    from analyses.feature_browser.cli import register
    from saes.io import save_sae

    monkeypatch.setenv("THOUGHTSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_sae(planted, tmp_path / "sae")
    cli = typer.Typer()
    register(cli)
    args = ["--model", "tiny-random:llama", "--site", SITE, "--sae", str(folder), "--n", "24", "--json"]
    result = CliRunner().invoke(cli, ["features", "search", "much", *args])
    assert result.exit_code == 0, result.output
    out = _json.loads(result.stdout.strip().splitlines()[-1])
    assert out["hits"][0]["latent"] == 11 and out["hits"][0]["link"] == f"/feature_browser?site={SITE}&latent=11"
    assert out["provenance"]["model"] == "tiny-random:llama" and out["provenance"]["settings"]["query"] == "much"
    assert (folder / LABELS_FILE).is_file()  # kept beside the SAE for the next search
    bad = CliRunner().invoke(cli, ["features", "search", "x" * 10_000, *args])
    assert bad.exit_code != 0 and "characters" in str(bad.exception)

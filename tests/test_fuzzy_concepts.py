"""Neuro-fuzzy concepts (analyses.fuzzy_concepts): the rule layer's maths against hand-worked values, recovery of
planted clusters, grounding, the baselines through the same metrics, the harvest (store, server), bad input,
the CLI and the page; end to end on the embedded model under the `model` marker.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from analyses.fuzzy_concepts import (KMeansConcepts, PCAConcepts, SemiNMFConcepts, FuzzyOptions,  # noqa: E402
                                     FuzzyRuleLayer, Sample, TextSource, evaluate_model, filter_words, ground_words,
                                     harvest, is_english_word, locate, run_study)
from analyses.fuzzy_concepts import metrics  # noqa: E402
from cache.store import ActivationStore  # noqa: E402
from thoughtscope.errors import BadInputError  # noqa: E402

DOG_TEXTS = ("At the park the dog ran.", "In the sea a dog swam.", "The big city dog barked.",
             "A small dog slept at home.", "Her old dog ate slowly.", "The farm dog chased sheep.",
             "A wet dog shook itself.", "My neighbour walks his dog daily.", "The police dog found it.",
             "A tired dog lay down.", "The happy dog wagged.", "One lost dog came back.", "The hungry dog waited.",
             "A brave dog saved him.", "The lazy dog yawned.", "That noisy dog again.", "Every morning the dog ate.",
             "Near the river, our dog drank.", "Under the table the dog hid.", "After school the dog played.")
SMALL_GRIDS = dict(sparsity_grid=(0.03,), features_grid=(4,), lr_grid=(0.03,), nmf_alpha_grid=(0.05,), steps=40)


def hand_layer(centres, widths, membership="gaussian") -> FuzzyRuleLayer:
    """A fitted layer set by hand: identity projection in 2-D, no standardisation."""
    layer = FuzzyRuleLayer(n_rules=len(centres), n_features=2, membership=membership)
    layer.mean_, layer.scale_ = torch.zeros(2), 1.0
    layer.projection_ = torch.eye(2)
    layer.centres_ = torch.tensor(centres, dtype=torch.float32)
    layer.widths_ = torch.tensor(widths, dtype=torch.float32)
    layer.consequents_ = torch.tensor([[10.0, 0.0], [0.0, 10.0]])
    layer.feature_mean_, layer.feature_std_ = torch.zeros(2), torch.ones(2)
    layer.loss_history_, layer.n_iter_ = [], 0
    return layer


def planted(k=4, d=32, n=400, spread=6.0, noise=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(k, d, generator=g) * spread / math.sqrt(2)
    labels = torch.arange(n) % k
    return centres, labels, centres[labels] + noise * torch.randn(n, d, generator=g)


# ----------------------------------------------------------------------------- the rule layer's maths


def test_gaussian_memberships_and_normalised_firing_equal_hand_computed_values():
    layer = hand_layer([[0.0, 0.0], [2.0, 0.0]], [1.0, 0.5])
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mu = layer.memberships(z)
    # sample 1: |z-c1|^2 = 1 with sigma 1 -> e^-0.5; |z-c2|^2 = 1 with sigma 0.5 -> e^-2
    # sample 2: |z-c1|^2 = 1 -> e^-0.5; |z-c2|^2 = 5 with sigma 0.5 -> e^-10
    want = torch.tensor([[math.exp(-0.5), math.exp(-2.0)], [math.exp(-0.5), math.exp(-10.0)]])
    torch.testing.assert_close(mu, want, rtol=1e-5, atol=1e-7)
    wbar = layer.transform(z)
    torch.testing.assert_close(wbar, want / want.sum(1, keepdim=True), rtol=1e-5, atol=1e-7)
    assert wbar[0, 0].item() == pytest.approx(0.8176, abs=1e-4)
    # defuzzification of sample 1: 0.8176 * (10, 0) + 0.1824 * (0, 10)
    torch.testing.assert_close(layer.reconstruct(z[:1]), torch.tensor([[8.1757, 1.8243]]), atol=1e-3, rtol=0)


def test_per_dimension_product_memberships_in_the_log_domain():
    layer = hand_layer([[0.0, 0.0], [1.0, 1.0]], [[1.0, 2.0], [0.5, 0.5]], membership="product")
    z = torch.tensor([[1.0, 2.0]])
    # rule 1: exp(-(1/2)(1^2/1 + 2^2/4)) = e^-1; rule 2: exp(-(1/2)(0 + 1/0.25)) = e^-2
    torch.testing.assert_close(layer.log_memberships(z), torch.tensor([[-1.0, -2.0]]), rtol=1e-6, atol=1e-6)
    far = torch.tensor([[400.0, 400.0]])  # memberships underflow to 0, the normalised firing does not
    assert layer.memberships(far).max() == 0
    wbar = layer.transform(far)
    assert torch.isfinite(wbar).all() and wbar.sum().item() == pytest.approx(1.0)


def test_defuzzification_is_a_convex_combination_of_the_consequents():
    _, _, Z = planted(k=3, d=16, n=120, spread=2.0)
    layer = FuzzyRuleLayer(n_rules=3, n_features=4, sparsity=0.0, steps=60, seed=0).fit(Z)
    wbar = layer.transform(Z)
    assert (wbar >= 0).all()
    torch.testing.assert_close(wbar.sum(1), torch.ones(len(Z)))
    z_hat = layer.reconstruct(Z)
    torch.testing.assert_close(z_hat, wbar @ layer.concepts_, rtol=1e-5, atol=1e-5)
    lo, hi = layer.concepts_.min(0).values, layer.concepts_.max(0).values
    assert ((z_hat >= lo - 1e-4) & (z_hat <= hi + 1e-4)).all()  # inside the consequents' bounding box
    torch.testing.assert_close(layer.inverse_transform(torch.eye(3)), layer.concepts_)


def test_rules_recover_planted_cluster_centres():
    centres, labels, Z = planted(k=4, d=32, n=400, spread=6.0, noise=1.0, seed=3)
    layer = FuzzyRuleLayer(n_rules=4, n_features=8, sparsity=0.03, steps=150, seed=0).fit(Z)
    dist = torch.cdist(layer.concepts_, centres).numpy()
    rows, cols = linear_sum_assignment(dist)
    separation = torch.pdist(centres).min().item()
    # about the sampling error of a cluster mean (noise * sqrt(d / 100) = 0.57), far below the separation
    assert dist[rows, cols].max() < 1.0 < 0.2 * separation
    assignment = layer.transform(Z).argmax(1)
    rule_of_cluster = dict(zip(cols.tolist(), rows.tolist()))
    assert (assignment == torch.tensor([rule_of_cluster[int(c)] for c in labels])).float().mean() > 0.98


def test_the_sparsity_penalty_makes_fewer_rules_fire_on_overlapping_clusters():
    _, _, Z = planted(k=6, d=64, n=600, spread=0.9, noise=1.0, seed=1)
    soft = FuzzyRuleLayer(n_rules=6, n_features=8, sparsity=0.0, steps=150, seed=0).fit(Z)
    crisp = FuzzyRuleLayer(n_rules=6, n_features=8, sparsity=0.1, steps=150, seed=0).fit(Z)
    assert metrics.active_concepts(crisp.transform(Z)) < metrics.active_concepts(soft.transform(Z)) - 0.3
    assert crisp.loss_history_[-1] <= crisp.loss_history_[0]


def test_same_seed_same_rules_and_a_saved_layer_loads_back(tmp_path):
    _, _, Z = planted(k=3, d=16, n=90, spread=3.0)
    a = FuzzyRuleLayer(n_rules=3, n_features=4, steps=30, seed=7).fit(Z)
    b = FuzzyRuleLayer(n_rules=3, n_features=4, steps=30, seed=7).fit(Z)
    torch.testing.assert_close(a.concepts_, b.concepts_, rtol=0, atol=0)
    a.save(tmp_path / "rules", metadata={"site": "resid_post.1"})
    assert sorted(p.name for p in (tmp_path / "rules").iterdir()) == ["config.json", "fuzzy_rules.safetensors"]
    loaded = FuzzyRuleLayer.load(tmp_path / "rules")
    assert loaded.get_params() == a.get_params() and loaded.metadata_ == {"site": "resid_post.1"}
    torch.testing.assert_close(loaded.transform(Z), a.transform(Z))
    assert [r.text() for r in loaded.rules()] == [r.text() for r in a.rules()]


def test_rules_read_as_if_then_and_a_sample_is_explained_by_its_rule_chain():
    layer = hand_layer([[0.0, 0.0], [3.0, 0.0]], [1.0, 1.0])
    layer.feature_std_ = torch.tensor([1.0, 1.0])
    rules = layer.rules(max_clauses=1)
    assert rules[1].text() == "Rule 2: IF f1 is very high (3.00 \u00b1 1.00) (and 1 more feature near their centres) " \
                              "THEN concept 2"
    e = layer.explain(torch.tensor([2.9, 0.1]))
    assert [link["rule"] for link in e.chain] == [1]  # rule 2 alone carries > 90% of the firing
    assert e.chain[0]["firing"] == pytest.approx(e.firing[1]) and e.firing[1] > 0.9
    assert e.chain[0]["clauses"][0]["value"] == pytest.approx(2.9)
    assert "rule 2 fires" in e.text()


# ----------------------------------------------------------------------------- grounding and metrics


def test_grounding_keeps_words_and_drops_stopwords_and_pieces(llama):
    assert filter_words([" the", " Dog", "ing", " dog", " 12", " park", "!", " and"], keep=15) == ["dog", "park"]
    ids = {w: llama.encode(w, add_special_tokens=False)[0] for w in (" the", " dog", " river")}
    emb = llama.model.get_output_embeddings().weight.detach()
    vector = 3 * emb[ids[" the"]] + 2 * emb[ids[" dog"]] + 2 * emb[ids[" river"]]
    readout = llama.readout(vector[None], norm=False, top_k=50)
    top = [llama.decode([i]) for i in readout.top_ids[0].tolist()]
    assert top[:3] == [" the", " dog", " river"]  # the raw readout is led by the stopword ...
    words = ground_words(llama, vector[None], top_k=50, keep=15)[0]
    assert "the" not in words and words[:2] == ["dog", "river"]  # ... the grounding drops it
    assert len(words) <= 15 and all(w.isalpha() for w in words)
    assert "iba" not in words and "returns" in words  # a word piece without its word-start space is no word


def test_word_start_pieces_that_are_not_english_words_are_dropped():
    # Pieces SmolLM2 returned in a grounding before the lexicon: word starts, but not words.
    pieces = [" auton", " incorpor", " excer", " facilit", " citiz", " articlegoogle", " keyerror", " ctypes"]
    words = [" approximately", " obstructions", " compared", " offending", " things", " studies", " stopped"]
    assert filter_words(pieces + words) == [w.strip() for w in words]
    assert not is_english_word("hass")  # "has" + s is no plural
    assert is_english_word("Sergeant") and is_english_word("fastest")


def test_baselines_go_through_the_same_metric_code():
    _, _, Z = planted(k=5, d=24, n=200, spread=3.0)
    pca = PCAConcepts(5).fit(Z)
    assert metrics.reconstruction_error(pca, Z) == pytest.approx(1 - pca.model_.explained_variance_ratio_.sum(), abs=1e-4)
    km = KMeansConcepts(5, seed=0).fit(Z)
    x = ((Z - km.mean_) / km.scale_).double().numpy()
    assert metrics.reconstruction_error(km, Z) == pytest.approx(km.model_.inertia_ / (x ** 2).sum(), rel=1e-4)
    nmf = SemiNMFConcepts(5, alpha=0.05, max_iter=50).fit(Z)
    assert (nmf.transform(Z) >= 0).all()  # semi-NMF: non-negative codes, free-signed dictionary
    assert (nmf.atoms_ < 0).any()
    fuzzy = FuzzyRuleLayer(5, n_features=4, steps=30).fit(Z)
    words = [["a%d" % i, "shared"] for i in range(5)]
    reports = {type(m).__name__: evaluate_model(m, Z[:50], words, {"cluster": [str(i % 5) for i in range(50)]})
               for m in (fuzzy, pca, km, nmf)}
    keys = {frozenset(r) for r in reports.values()}
    assert len(keys) == 1  # one set of metrics for every method
    assert all(r["word_overlap"] == pytest.approx(0.5) for r in reports.values())  # 1 of 2 words shared
    assert reports["KMeansConcepts"]["active_concepts"] == pytest.approx(1.0)
    assert reports["PCAConcepts"]["active_concepts"] > reports["KMeansConcepts"]["active_concepts"]


def test_word_overlap_stability_and_intervals_by_hand():
    matrix, mean = metrics.word_overlap([["a", "b"], ["b", "c", "d", "e"], ["f"]])
    assert matrix[0, 1] == 0.5 and matrix[1, 0] == 0.25 and mean == pytest.approx(0.75 / 6)
    u = torch.eye(3)
    assert metrics.matched_similarity(u, u[[2, 0, 1]]) == pytest.approx(1.0)  # order does not matter
    # a0-b1 (cosine 1) and a1-b0 (0.8) beat the diagonal pairing (0.6 + 0)
    assert metrics.matched_similarity([[1.0, 0.0], [0.0, 2.0]], [[0.6, 0.8], [3.0, 0.0]]) == pytest.approx(0.9)
    mean, low, high = metrics.seed_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and high - mean == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)  # t(0.975, 2) * s / sqrt(n)
    assert metrics.adjusted_mutual_information(np.eye(3)[[0, 0, 1, 1, 2, 2]], list("aabbcc")) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- harvest


def test_locate_reads_the_last_token_of_the_word_in_the_generated_part(llama):
    prompt = llama.encode("Write about water.")
    gen = llama.encode(" The waterfall and the water were cold.", add_special_tokens=False)
    s = locate(llama, prompt + gen, "water", "x", prompt_tokens=len(prompt), where="generated")
    assert s.text[s.span[0]:s.span[1]] == "water" and s.span[0] >= s.prompt_chars  # not "waterfall", not the prompt
    assert llama.token_texts(s.ids)[s.position].strip() == "water"
    assert locate(llama, prompt + llama.encode(" Nothing here.", add_special_tokens=False), "water", "y",
                  prompt_tokens=len(prompt), where="generated") is None
    fallback = locate(llama, prompt + llama.encode(" Nothing.", add_special_tokens=False), "water", "z",
                      prompt_tokens=len(prompt), where="any")
    assert fallback.span[1] <= fallback.prompt_chars  # the prompt's occurrence
    multi = locate(llama, llama.encode("a hotdog and a Hotdogs and hot-dog"), "hot-dog", "m")
    assert multi.text[multi.span[0]:multi.span[1]] == "hot-dog" and multi.position == len(multi.ids) - 1


def test_harvest_stores_rows_and_a_rerun_reads_them_back(llama, tmp_path):
    store = ActivationStore(tmp_path / "store")
    source = TextSource("dog", kind="texts", texts=DOG_TEXTS, n=12)
    progress = []
    first = harvest(llama, source, 1, store=store, batch_size=5, on_progress=lambda *a: progress.append(a))
    assert first.Z.shape == (12, 64) and first.n_from_cache == 0 and first.site == "resid_post.1"
    assert progress[-1] == ("read", 12, 12)
    direct = llama.capture(DOG_TEXTS[0], ["resid_post.1"])["resid_post.1"][first.samples[0].position]
    torch.testing.assert_close(first.Z[0], direct, rtol=1e-4, atol=1e-5)
    again = harvest(llama, source, 1, store=store)
    assert again.n_from_cache == 12
    torch.testing.assert_close(again.Z, first.Z, rtol=0, atol=0)


# ----------------------------------------------------------------------------- bad input, before any fitting


class NaNSource(TextSource):
    """A representation source whose rows are broken (the shape an image source would also have)."""

    def read(self, backend, samples, site):
        rows = super().read(backend, samples, site)
        rows[1, 3] = float("nan")
        return rows


def test_bad_input_is_a_project_error_before_any_fitting(llama, monkeypatch):
    calls = []
    monkeypatch.setattr(FuzzyRuleLayer, "_init", lambda *a: calls.append("fit") or (_ for _ in ()).throw(AssertionError))
    # K larger than the number of samples: refused from the options alone, before the harvest
    with pytest.raises(BadInputError, match="K = 20 concepts but only"):
        run_study(llama, FuzzyOptions(word="dog", source="texts", texts=DOG_TEXTS, n=10, k=20, layer=1))
    # ... and by the layer itself
    with pytest.raises(BadInputError, match="K = 5 concepts but only 3"):
        FuzzyRuleLayer(n_rules=5).fit(torch.randn(3, 8))
    with pytest.raises(BadInputError, match="only 1 distinct"):
        FuzzyRuleLayer(n_rules=2).fit(torch.ones(6, 8))
    # a layer out of range
    with pytest.raises(BadInputError, match="layer 7 is out of range: this model has layers 0..1"):
        run_study(llama, FuzzyOptions(word="dog", source="texts", texts=DOG_TEXTS, n=20, k=2, layer=7))
    # a word that never occurs
    with pytest.raises(BadInputError, match="never occurs"):
        run_study(llama, FuzzyOptions(word="giraffe", source="texts", texts=DOG_TEXTS, n=20, k=2, layer=1))
    # NaN representations: from a source, and handed to fit directly
    with pytest.raises(BadInputError, match="NaN"):
        harvest(llama, NaNSource("dog", kind="texts", texts=DOG_TEXTS, n=6), 1)
    Z = torch.randn(10, 4)
    Z[2, 1] = float("nan")
    with pytest.raises(BadInputError, match="NaN or infinite values in 1 of 10 rows"):
        FuzzyRuleLayer(n_rules=2).fit(Z)
    # the fit's settings, from the options alone (each was said only when the first fit began, after the harvest)
    from analyses.fuzzy_concepts import study as study_module

    harvested = []
    monkeypatch.setattr(study_module, "harvest", lambda *a, **k: harvested.append(a))
    base = dict(word="dog", source="texts", texts=DOG_TEXTS, n=20, k=2, layer=1)
    for bad, says in ((dict(membership="triangle"), "membership 'triangle' is not an option"),
                      (dict(steps=0), "steps (gradient steps of the fuzzy layer) must be an integer >= 1"),
                      (dict(max_active=float("nan")), "max_active"),
                      (dict(sparsity_grid=(0.01, float("nan"))), "a sparsity of the development grid"),
                      (dict(features_grid=(8, 0)), "a feature count m of the development grid"),
                      (dict(lr_grid=(-1.0,)), "a learning rate of the development grid"),
                      (dict(nmf_alpha_grid=(float("inf"),)), "a semi-NMF L1 weight")):
        with pytest.raises(BadInputError, match=re.escape(says)):
            run_study(llama, FuzzyOptions(**base, **bad))
    assert calls == [] and harvested == []


# ----------------------------------------------------------------------------- the study, the CLI, the server


@pytest.fixture(scope="module")
def tiny_study(llama, tmp_path_factory):
    store = ActivationStore(tmp_path_factory.mktemp("fz") / "store")
    options = FuzzyOptions(word="dog", source="texts", texts=DOG_TEXTS, n=20, k=2, seeds=3, layer=1, **SMALL_GRIDS)
    return run_study(llama, options, store=store)


def test_the_study_reports_every_method_on_held_out_samples(tiny_study):
    study = tiny_study
    assert set(study.splits) == {"train", "dev", "eval"} and len(study.splits["eval"]) == 4
    assert not set(study.splits["eval"]) & (set(study.splits["train"]) | set(study.splits["dev"]))
    table = study.metric_table()
    assert [r["method"] for r in table] == ["fuzzy", "semi-NMF", "k-means", "PCA"]
    for row in table:
        for name in ("reconstruction_error", "active_concepts", "word_overlap", "stability"):
            assert row[f"{name}_low"] <= row[name] <= row[f"{name}_high"]
    assert len(study.per_seed) == 3 * 4 and {r["seed"] for r in study.per_seed} == {0, 1, 2}
    assert study.tuning["fuzzy"].chosen == {"n_features": 4, "sparsity": 0.03, "lr": 0.03}
    assert set(study.paired) == {"semi-NMF", "k-means", "PCA"}
    assert study.paired["PCA"]["wilcoxon"]["n"] == 4
    assert all(r.text().startswith(f"Rule {r.index + 1}: IF f") for r in study.rules)
    explained = study.explain(study.splits["eval"][0])
    assert explained["split"] == "eval" and sum(explained["firing"]) == pytest.approx(1.0, abs=1e-5)
    payload = json.loads(json.dumps(study.to_dict()))
    assert payload["representations"]["n_samples"] == 20 and len(payload["rules"]) == 2


def test_the_figures_build_from_the_exported_json(tiny_study):
    from app.export import figure_registry
    from app.figures.fuzzy_concepts import FIGURES

    data = json.loads(json.dumps(tiny_study.to_dict()))
    registry = figure_registry()
    assert set(FIGURES) <= set(registry)
    fig = registry["fuzzy_metrics"]({"metric_table": data["metric_table"], "seeds": 3})
    assert [t.x for t in fig.data][0] == ("fuzzy", "semi-NMF", "k-means", "PCA")
    fig = registry["fuzzy_overlap"]({"overlap_matrix": data["overlap_matrix"]["fuzzy"], "method": "fuzzy"})
    assert np.array(fig.data[0].z).shape == (2, 2)
    e = tiny_study.explain(0)
    assert list(registry["fuzzy_firing"](e).data[0].y) == pytest.approx(e["firing"])
    assert registry["fuzzy_tuning"](data["tuning"]["fuzzy"]).data[1].name == "chosen"


def test_cli_json_has_every_method_and_a_provenance_record(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from thoughtscope import cli as cli_module

    monkeypatch.setattr("cache.store.default_root", lambda: tmp_path / "store")
    (tmp_path / "dogs.txt").write_text("\n".join(DOG_TEXTS))
    result = CliRunner().invoke(cli_module.build(), [
        "eval", "fuzzy-concepts", "--model", "tiny-random:llama", "--token", "dog", "--texts", str(tmp_path / "dogs.txt"),
        "--k", "2", "--seeds", "2", "--layer", "1", "--sparsity", "0.03", "--features", "4", "--lr", "0.03",
        "--nmf-alpha", "0.05", "--steps", "20", "--save", str(tmp_path / "rules"), "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["method"] for r in payload["metric_table"]] == ["fuzzy", "semi-NMF", "k-means", "PCA"]
    prov = payload["provenance"]
    assert prov["model"] == "tiny-random:llama" and prov["command"] == "thoughtscope eval fuzzy-concepts"
    assert prov["site"] == "resid_post.1" and prov["chosen"]["fuzzy"]["n_features"] == 4
    assert FuzzyRuleLayer.load(tmp_path / "rules").metadata_["word"] == "dog"


@pytest.fixture(scope="module")
def served_url(tiny_server_url):
    """`thoughtscope serve` with tiny-random:llama in a subprocess on a free loopback port: the session's
    (tests/conftest.py)."""
    return tiny_server_url


def test_a_fit_on_rows_harvested_through_the_server_equals_in_process(llama, served_url):
    from probes.client import RemoteBackend

    with RemoteBackend(served_url, timeout=120) as remote:
        # generated samples (sampled through the server's stream, same seed) give the same tokens and rows
        source = TextSource("dog", kind="generate", n=6, where="any", max_new_tokens=6, batch_size=3)
        local, served = harvest(llama, source, 1), harvest(remote, source, 1)
        assert [s.key for s in served.samples] == [s.key for s in local.samples]
        torch.testing.assert_close(served.Z, local.Z, rtol=1e-5, atol=1e-5)
        # and a fit on the served rows of varied texts equals the in-process fit
        source = TextSource("dog", kind="texts", texts=DOG_TEXTS, n=12)
        local, served = harvest(llama, source, 1), harvest(remote, source, 1)
        torch.testing.assert_close(served.Z, local.Z, rtol=1e-5, atol=1e-5)
        a = FuzzyRuleLayer(n_rules=2, n_features=3, steps=25, seed=1).fit(local.Z)
        b = FuzzyRuleLayer(n_rules=2, n_features=3, steps=25, seed=1).fit(served.Z)
        torch.testing.assert_close(b.concepts_, a.concepts_, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.transform(local.Z), a.transform(local.Z), rtol=1e-4, atol=1e-4)
        assert [r.text() for r in b.rules()] == [r.text() for r in a.rules()]


# ----------------------------------------------------------------------------- the page


def _run_page(at, source: str, k: int, n: int, seeds: int = 2, steps: int = 20, word: str | None = None,
              texts: list[str] | None = None, layer: int | None = None):
    """Fill the page's settings as a user would, then press Harvest + fit."""
    at.selectbox(key="fz_source").set_value(source)
    at.run()
    if texts is not None:
        at.text_area(key="fz_texts").set_value("\n".join(texts))
    if word is not None:
        at.text_input(key="fz_word").set_value(word)
    for key, value in (("fz_k", k), ("fz_n", n), ("fz_seeds", seeds), ("fz_steps", steps)):
        at.number_input(key=key).set_value(value)
    if layer is not None:
        at.selectbox(key="fz_layer").set_value(layer)
    at.run()
    from tests.apptest_helpers import finish_jobs

    return finish_jobs(at.button(key="fz_run").click().run())  # the harvest + fit runs as a job


def _steer(at, scale: float | None = None):
    """Move the steering scale (if given) and press the steering button; wait for its job."""
    from tests.apptest_helpers import finish_jobs

    if scale is not None:
        at.slider(key="fz_steer_scale").set_value(scale).run()
    return finish_jobs(at.button(key="fz_steer_run").click().run())


def _open_page(monkeypatch, tmp_path, **env: str):
    """The page on the backend `env` names (THOUGHTSCOPE_MODEL or THOUGHTSCOPE_SERVER), with a store of its own
    and no results from earlier tests; checked clean. Callers clear `jobs.registry` when done."""
    from tests import apptest_helpers as helpers

    from app import jobs

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("cache.store.default_root", lambda: tmp_path / "store")
    jobs.registry.clear()  # no finished result of an earlier test
    at = helpers.open_page("fuzzy_concepts", 6)
    helpers.assert_clean(at)
    return at


def test_the_page_runs_a_study_and_draws_cards_firing_overlap_and_steering(monkeypatch, tmp_path):
    from tests import apptest_helpers as helpers

    from app import jobs

    at = _open_page(monkeypatch, tmp_path, THOUGHTSCOPE_MODEL="tiny-random:llama")
    assert any("Harvest + fit" in i.value for i in at.info) and not at.get("plotly_chart")
    _run_page(at, "texts", k=2, n=20, word="dog", texts=DOG_TEXTS, layer=0)
    helpers.assert_clean(at)
    assert helpers.metric(at, "Site") == "resid_post.0"
    assert list(at.dataframe[0].value["method"]) == ["fuzzy", "semi-NMF", "k-means", "PCA"]
    titles = helpers.chart_titles(at)
    assert any(t.startswith("Fuzzy rules vs baselines") for t in titles)
    assert any(t.startswith("Rule firing for") for t in titles)
    assert any(t.startswith("Grounded-word overlap between concepts (fuzzy") for t in titles)
    assert sum("IF f" in c.value for c in at.code) == 2  # one card per rule
    # the overlap heat map follows the method
    at.radio(key="fz_overlap_method").set_value("k-means").run()
    assert any(t.startswith("Grounded-word overlap between concepts (k-means") for t in helpers.chart_titles(at))
    # steering (a job): scale 0 leaves the text as it is, a large scale changes it
    _steer(at)
    texts = [t.value for t in at.text][-2:]
    assert texts[0] == texts[1]
    _steer(at, 8.0)
    helpers.assert_clean(at)
    unsteered, steered = [t.value for t in at.text][-2:]
    assert unsteered == texts[0] and steered != unsteered
    at.button(key="fz_add_to_stack").click().run()  # the concept goes into the Steering page's stack
    from app.steering_stack_ui import STACK

    term = at.session_state[STACK]["stack"].terms[-1]
    assert (term.site, term.source) == ("resid_post.0", {"kind": "fuzzy_concept", "rule": 0})
    # the layer selector: another layer is another study
    at.selectbox(key="fz_layer").set_value(1).run()
    helpers.finish_jobs(at.button(key="fz_run").click().run())
    helpers.assert_clean(at)
    assert helpers.metric(at, "Site") == "resid_post.1"
    jobs.registry.clear()


def test_the_page_runs_through_the_model_server(served_url, monkeypatch, tmp_path):
    from tests import apptest_helpers as helpers

    from app import jobs

    at = _open_page(monkeypatch, tmp_path, THOUGHTSCOPE_SERVER=served_url)
    _run_page(at, "texts", k=2, n=20, word="dog", texts=DOG_TEXTS)
    helpers.assert_clean(at)
    assert helpers.metric(at, "Samples") == "20"
    assert sum("IF f" in c.value for c in at.code) == 2
    _steer(at, 8.0)
    helpers.assert_clean(at)
    unsteered, steered = [t.value for t in at.text][-2:]
    assert steered != unsteered
    jobs.registry.clear()


# ----------------------------------------------------------------------------- the embedded model


@pytest.mark.model
def test_end_to_end_on_the_embedded_model(smollm2, tmp_path):
    store = ActivationStore(tmp_path / "store")
    options = FuzzyOptions(word="total", source="gsm8k", n=40, k=3, seeds=2, layer=20, steps=60,
                           sparsity_grid=(0.01, 0.1), features_grid=(8,), lr_grid=(0.03,), nmf_alpha_grid=(0.05,))
    study = run_study(smollm2, options, store=store)
    assert study.reps.Z.shape == (40, 576) and study.reps.site == "resid_post.20"
    assert all(s.text[s.span[0]:s.span[1]].lower() == "total" for s in study.reps.samples)
    table = {r["method"]: r for r in study.metric_table()}
    assert 0 < table["fuzzy"]["reconstruction_error"] < 1 and 0 < table["PCA"]["reconstruction_error"] < 1
    assert len(study.tuning["fuzzy"].to_dict()["grid"]) == 2
    words = study.words["fuzzy"]
    assert all(0 < len(w) <= 15 for w in words)  # a real model grounds every concept in some words
    assert not {"the", "and", "of"} & {w for ws in words for w in ws}
    e = study.explain(study.splits["eval"][0])
    assert e["chain"] and "fires" in e["text"]


def test_the_fuzzy_fit_benchmark_times_both_fits_on_the_same_rows():
    from analyses.fuzzy_concepts.bench import bench_fuzzy_fit

    row = bench_fuzzy_fit(n=300, width=32, k=4, steps=20, nmf_max_iter=5)
    assert row["bench"] == "fuzzy_fit" and row["fuzzy_steps_run"] == 20  # tol=0: every step runs
    assert row["ratio"] == pytest.approx(row["fuzzy_seconds"] / row["semi_nmf_seconds"])
    assert 0 < row["fuzzy_reconstruction_error"] < 1 and 0 < row["semi_nmf_reconstruction_error"] < 1


# ----------------------------------------------------------------------------- images: toy-vlm scenes


def test_scene_concepts_refuse_a_text_only_model():
    from analyses.fuzzy_concepts.scenes import SceneSource
    from probes import Engine

    with pytest.raises(BadInputError, match="takes no images"):
        SceneSource(n=3).samples(Engine.from_id("tiny-random:llama"))
    with pytest.raises(BadInputError, match="positive integer"):
        SceneSource(n=0).validate()


@pytest.mark.model
def test_scene_concepts_on_toy_vlm_read_the_answer_mark_and_score_against_the_scenes(tmp_path):
    """toy-vlm:small (trained once, cached): each row is the hidden state where the model is about to
    answer, equal to a direct capture of that scene; labels are the asked object's true attributes."""
    from probes import Engine
    from probes.toys import vlm

    engine = Engine.from_id("toy-vlm:small")
    options = FuzzyOptions(word="answer", source="toy-vlm-scenes", n=40, k=3, seeds=2, layer=1, steps=60,
                           sparsity_grid=(0.01,), features_grid=(8,), lr_grid=(0.03,), nmf_alpha_grid=(0.05,))
    study = run_study(engine, options, store=ActivationStore(tmp_path / "store"))
    samples = study.reps.samples
    assert study.reps.Z.shape == (40, engine.info()["arch"]["d_model"]) and study.reps.site == "resid_post.1"
    assert all(s.text[s.span[0]:s.span[1]] == "answer" for s in samples)
    assert {s.labels["question"] for s in samples} == {"colour", "shape"}
    ex = next(e for e in vlm.example_stream("eval", 0) if e.qtype in ("colour", "shape"))
    asked = next(o for o in ex.objects if vlm.matches(o, ex.key))
    assert samples[0].labels == {"colour": asked.colour, "shape": asked.shape, "question": ex.qtype}
    direct = engine.capture(samples[0].text, ["resid_post.1"], images=[ex.image])["resid_post.1"]
    assert torch.equal(study.reps.Z[0], direct[samples[0].position].float())
    tokens = engine.token_texts(engine.trace(samples[0].text, images=[ex.image]).token_ids)
    assert tokens[samples[0].position].strip() == "answer"  # the position that predicts the answer word
    table = {r["method"]: r for r in study.metric_table()}
    assert {"ami_colour", "ami_shape", "ami_question"} <= set(table["fuzzy"])
    assert 0 < table["fuzzy"]["reconstruction_error"] < 1


@pytest.mark.model
def test_the_page_offers_scenes_on_a_vision_model_and_scores_them(monkeypatch, tmp_path):
    from tests import apptest_helpers as helpers

    at = _open_page(monkeypatch, tmp_path, THOUGHTSCOPE_MODEL="toy-vlm:small")
    assert "toy-vlm-scenes" in at.selectbox(key="fz_source").options
    _run_page(at, "toy-vlm-scenes", k=3, n=30)
    helpers.assert_clean(at, no_errors=False)
    # steering continues the sidebar's prompt (longer than this toy's context) only when its button is pressed
    assert all("this model's context is 64" in e.value for e in at.error)
    table = at.dataframe[0].value
    assert list(table["method"]) == ["fuzzy", "semi-NMF", "k-means", "PCA"]
    assert {"AMI (colour)", "AMI (shape)"} <= set(table.columns), list(table.columns)


@pytest.mark.model
def test_scene_rows_through_the_model_server_equal_in_process(tmp_path):
    """Images travel to `thoughtscope serve` as bytes; the harvested rows are the same."""
    from analyses.fuzzy_concepts.harvest import harvest
    from analyses.fuzzy_concepts.scenes import SceneSource
    from probes.server_bench import served

    with served("toy-vlm:small") as (engine, remote):
        here = harvest(engine, SceneSource(n=6), layer=1)
        there = harvest(remote, SceneSource(n=6), layer=1)
    assert [s.labels for s in here.samples] == [s.labels for s in there.samples]
    assert torch.allclose(here.Z, there.Z, atol=1e-5)


@pytest.mark.parametrize("word", ["", "   ", None])
def test_an_empty_target_word_is_asked_for_in_words_the_page_shares(word):
    """The page's emptied "Target word" box said "give the target word (--token WORD), e.g. --token water": the
    command line's syntax (the fuzzing pass of 2026-12-07). The command line checks --token itself first."""
    from analyses.fuzzy_concepts.harvest import check_word

    with pytest.raises(BadInputError) as refused:
        check_word(word)
    assert str(refused.value) == "give a target word, e.g. water (the word whose hidden states are decomposed)"

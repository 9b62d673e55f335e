"""RISE (analyses/rise/): steps, labels, step vectors, column association, held-out quality, steering, the pipeline.

Unit tests use `tiny-random:llama`; the `model` tests run RISE on the `toy-reasoner:small` organism,
whose planted behaviours give the ground truth (issue 11).
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from analyses import rise  # noqa: E402
from analyses.rise import (  # noqa: E402
    HarvestSettings,
    associate_columns,
    behaviour_vectors,
    decoder_geometry,
    label_step,
    locate_step_tokens,
    split_steps,
)
from analyses.tasks import arithmetic_problems  # noqa: E402
from thoughtscope.errors import BadInputError  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from probes.engine import Engine

    return Engine.from_id("tiny-random:llama")


# --------------------------------------------------------------------------- steps


def test_sentence_steps_and_their_closing_tokens():
    pieces = ["Tom", " has", " 4", ".", " He", " buys", " 2.", "5", " more", "!", " So", " 6", ".5", ". The", " end"]
    text = "".join(pieces)
    assert text == "Tom has 4. He buys 2.5 more! So 6.5. The end"
    steps = locate_step_tokens(pieces, split_steps(text, "sentence"))
    assert [s.text for s in steps] == ["Tom has 4.", "He buys 2.5 more!", "So 6.5.", "The end"]
    # The token holding each step's last character: ".", "!", ". The" (which also opens the next step), " end".
    assert [s.token for s in steps] == [3, 9, 13, 14]
    assert [s.closed for s in steps] == [True, True, True, False]
    assert text[steps[1].start:steps[1].end] == " He buys 2.5 more!"


def test_paragraph_steps_close_on_the_blank_line_token():
    pieces = ["First", " we", " add", ".\n\n", "Wait", ",", " check", ".", "\n", "\n", "\n\n", "Done", "."]
    steps = locate_step_tokens(pieces, split_steps("".join(pieces), "\n\n"))
    assert [s.text for s in steps] == ["First we add.", "Wait, check.", "Done."]
    assert [s.token for s in steps] == [3, 9, 12]  # ".\n\n", the second "\n", then the tail's "."
    assert steps[-1].closed is False


def test_delimiter_resolution():
    from analyses.steps import PARAGRAPH, SENTENCE

    assert rise.resolve_delimiter("auto", "smollm2-135m") == SENTENCE == rise.resolve_delimiter("sentence")
    assert rise.resolve_delimiter("auto", "hf:deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B") == PARAGRAPH
    assert rise.resolve_delimiter("\\n\\n") == "\\n\\n"  # a regex: it matches a blank line
    with pytest.raises(BadInputError):
        rise.resolve_delimiter("")


def test_keyword_labels_and_judge_hook():
    assert label_step("Wait, that's not right.") == "reflection"
    assert label_step("Let me make sure: it’s correct.") == "reflection"
    assert label_step("Alternatively, we can think differently.") == "backtracking"
    assert label_step("Let me try another approach; wait.") == "backtracking"  # first keyword wins
    assert label_step("The waiter brings 3 plates.") == "other"  # whole words only
    assert label_step("So 3 + 4 = 7.", judge=lambda text: "reflection") == "reflection"
    assert label_step("Wait.", judge=lambda text: None) == "reflection"  # judge abstains
    with pytest.raises(BadInputError):
        label_step("x", judge=lambda text: "confused")


# --------------------------------------------------------------------------- step vectors and steering


def test_batched_step_vectors_equal_single_teacher_forced_traces(tiny):
    sequences = [tiny.encode("Question: what is 2 + 2? Answer: it is 4. Done."),
                 tiny.encode("Question: what is 2 + 2? Answer: four, surely."),
                 tiny.encode("Question: what is 2 + 2? Hmm.")]
    positions = [[10, 12, len(sequences[0]) - 1], [9, 11], [len(sequences[2]) - 1]]
    got = rise.step_residuals(tiny, sequences, positions, layers=(0, 1), batch_size=2)
    for ids, pos, vectors in zip(sequences, positions, got):
        ref = tiny.trace(ids, capture=["resid_post.0", "resid_post.1"])
        for site in ("resid_post.0", "resid_post.1"):
            assert torch.allclose(vectors[site], ref.activations[site][pos], atol=1e-5)


def test_projection_removes_the_component_at_alpha_one(tiny):
    w = torch.randn(64, generator=torch.Generator().manual_seed(0))
    w_unit = w / w.norm()
    text = "Tom has 4 apples. He buys 3 more."
    plain = tiny.trace(text, capture=["resid_post.0"]).activations["resid_post.0"]
    for alpha, factor in ((1.0, 0.0), (-1.0, 2.0), (0.5, 0.5)):
        iv = rise.steering_intervention("resid_post.0", w, alpha, mode="projection")
        iv.where = "all"  # a teacher-forced pass has no generated tokens; apply everywhere
        edited = tiny.trace(text, capture=["resid_post.0"], interventions=[iv]).activations["resid_post.0"]
        assert torch.allclose(edited @ w_unit, factor * (plain @ w_unit), atol=1e-4)
        # and nothing orthogonal to w changes
        ortho = lambda h: h - (h @ w_unit)[:, None] * w_unit  # noqa: E731
        assert torch.allclose(ortho(edited), ortho(plain), atol=1e-4)
    with pytest.raises(BadInputError):
        rise.steering_intervention("resid_post.0", w, 1.0, mode="rotate")


# --------------------------------------------------------------------------- columns


def test_argmax_votes_make_column_sets_and_shared_columns_are_dropped():
    # 8 columns. Reflection steps peak at 2 (or 3, shared with backtracking); backtracking at 5 (or 3).
    rows, labels = [], []
    for col, label, count in ((2, "reflection", 4), (3, "reflection", 1), (5, "backtracking", 3),
                              (3, "backtracking", 2), (0, "other", 5)):
        for _ in range(count):
            z = torch.zeros(8)
            z[col], z[(col + 1) % 8] = 2.0, 0.5
            rows.append(z)
            labels.append(label)
    rows.append(torch.zeros(8))  # a step where nothing fires does not vote
    labels.append("reflection")
    assoc = associate_columns(torch.stack(rows), labels, top_n=2)
    assert assoc.votes["reflection"] == {2: 4, 3: 1}
    assert assoc.column_sets == {"reflection": [2, 3], "backtracking": [5, 3], "other": [0]}
    assert assoc.column_labels[3] == "backtracking" and assoc.column_labels[7] is None

    w_dec = torch.eye(8)
    vectors = behaviour_vectors(w_dec, assoc.column_sets)
    assert torch.allclose(vectors["reflection"], w_dec[2])  # 3 is shared, dropped
    assert torch.allclose(vectors["backtracking"], w_dec[5])
    assert all(abs(float(v.norm()) - 1) < 1e-6 for v in vectors.values())


def test_silhouette_separates_planted_groups_and_is_undefined_for_one():
    gen = torch.Generator().manual_seed(0)
    centres = torch.eye(16)[:2] * 5
    w = torch.cat([centres[0] + 0.3 * torch.randn(10, 16, generator=gen), centres[1] + 0.3 * torch.randn(10, 16, generator=gen)])
    labels = ["reflection"] * 10 + ["backtracking"] * 10
    coords, sil, sil_map = decoder_geometry(w, labels, method="pca")
    assert coords.shape == (20, 2) and sil > 0.8 and sil_map > 0.8
    assert decoder_geometry(w, ["other"] * 20, method="pca")[1] is None


# --------------------------------------------------------------------------- pipeline on the tiny model


def test_pipeline_end_to_end_on_a_tiny_model(tiny, tmp_path, monkeypatch):
    from app.figures import rise as figs
    from cache.store import ActivationStore
    from saes.train import SAETrainSettings, train_sae

    store = ActivationStore(tmp_path / "store")
    problems = arithmetic_problems(12, seed=0)
    settings = HarvestSettings(layers=(0, 1), max_new_tokens=10, batch_size=6, augment="templated", delimiter="sentence")

    # Interrupted after the first batch: what was done is stored, a rerun only does the rest.
    real = sys.modules["analyses.rise.harvest"].step_residuals
    calls = []

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    harvest_module = sys.modules["analyses.rise.harvest"]
    monkeypatch.setattr(harvest_module, "step_residuals", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        rise.harvest(tiny, problems, settings, store=store)
    monkeypatch.setattr(harvest_module, "step_residuals", real)
    harvest = rise.harvest(tiny, problems, settings, store=store)
    assert harvest.n_from_cache == 6
    again = rise.harvest(tiny, problems, settings, store=store)
    assert again.n_from_cache == 12 and torch.equal(again.acts["resid_post.1"], harvest.acts["resid_post.1"])

    n_steps = len(harvest.step_rows)
    assert harvest.acts["resid_post.0"].shape == (n_steps, 64)
    counts = harvest.label_counts()
    assert counts["reflection"] + counts["backtracking"] == 12  # one templated step per trace
    json.dumps(harvest.to_dict(with_traces=True))

    saes = {site: train_sae(acts, SAETrainSettings.scaled(64, len(acts), steps=60, progress=False))[0]
            for site, acts in harvest.acts.items()}
    analysis = rise.analyse(harvest, saes, method="pca")
    assert [la.site for la in analysis.layers] == ["resid_post.0", "resid_post.1"]
    json.dumps(analysis.to_dict())
    layer = analysis.layer(analysis.best_site)
    assert layer.coords.shape == (saes[layer.site].cfg.d_sae, 2)

    latent = int(layer.top_latents[0, 0])
    board = rise.feature_dashboard(harvest, saes[layer.site], layer.site, latent, tiny)
    unembed = tiny.model.get_output_embeddings().weight.detach()
    want = (unembed @ saes[layer.site].W_dec[latent].detach()).topk(10).indices.tolist()
    assert [word for word, _ in board.promoted_tokens] == [tiny.decode([i]) for i in want]
    assert len(board.promoted_tokens) == 10 and sum(board.histogram_counts) == round(board.density * n_steps)
    json.dumps(board.to_dict())

    direction = saes[layer.site].W_dec[latent].detach()
    steering = rise.steer(tiny, arithmetic_problems(15, seed=0)[12:], direction, layer.site, alphas=(0.0, 1.0),
                          settings=settings)
    assert [r.alpha for r in steering.rows] == [0.0, 1.0] and steering.rows[0].n == 3

    confidence = rise.confidence_vectors(tiny, harvest, saes[layer.site], layer.site, iterations=3, batch_size=2)
    assert len(confidence.entropy_history) == 3 and len(confidence.top_columns) == 10
    assert confidence.vector(saes[layer.site].W_dec).shape == (64,)

    for fig in (figs.step_timeline(harvest.traces[0]), figs.decoder_map(layer), figs.silhouette_curve(analysis),
                figs.feature_histogram(board), figs.feature_tokens(board), figs.feature_labels(board),
                figs.steering_table(steering), figs.steering_bars(steering), figs.confidence_curve(confidence)):
        assert fig.layout.template.layout.font.family.startswith("Helvetica")


@pytest.mark.parametrize("mode", ["projection", "add"])
def test_a_batched_alpha_grid_equals_one_generation_per_alpha(tiny, mode):
    """The RISE page's slider grid: every alpha of a problem as a row of one greedy generation gives the
    same traces, token for token, as generating each alpha alone; alpha 0 rows are the vanilla traces."""
    from analyses.rise.steer import steering_intervention

    settings = HarvestSettings(layers=(1,), max_new_tokens=12, batch_size=4, delimiter="sentence")
    direction = torch.linspace(-3, 2, 64)
    problems = arithmetic_problems(3, seed=4)
    alphas = (-1.5, 0.0, 0.75, 1.5)
    alone = rise.steer(tiny, problems, direction, "resid_post.1", alphas=alphas, mode=mode, settings=settings)
    grid = rise.steer(tiny, problems, direction, "resid_post.1", alphas=alphas, mode=mode, settings=settings,
                      batch_alphas=True)
    for a in alphas:
        assert [t.gen_ids for t in grid.traces[a]] == [t.gen_ids for t in alone.traces[a]]
    assert [r.to_dict() | {"generation_seconds": 0} for r in grid.rows] == \
        [r.to_dict() | {"generation_seconds": 0} for r in alone.rows]
    # the steering is real: some alpha moves some trace away from vanilla
    assert any(grid.traces[a][i].gen_ids != grid.traces[0.0][i].gen_ids
               for a in alphas if a for i in range(len(problems)))
    iv = steering_intervention("resid_post.1", direction, [0.5, -1.0], mode)
    iv.validate(tiny.handle.arch)
    assert "per row" in iv.describe()


@pytest.mark.parametrize("batch_alphas", [True, False])
def test_a_stop_during_a_steering_sweep_ends_it_within_one_model_call(tiny, batch_alphas):
    """The RISE page's Stop: the job's check (`probes.cancel`) runs before every forward, so once it raises the
    sweep ends there. (A batched grid reports progress only when its one generation ends: a Stop at the next
    progress report waited for the whole grid, 11 s on SmolLM2.)"""
    from probes import cancel
    from tests.counting import ForwardCounter

    settings = HarvestSettings(layers=(1,), max_new_tokens=12, batch_size=8, delimiter="sentence")
    problems = arithmetic_problems(2, seed=4)
    counter, checks = ForwardCounter(tiny.model), []

    def stop_after_third_forward() -> None:
        checks.append(counter.calls)
        if len(checks) == 4:  # the check before the 4th forward: Stop was pressed during the 3rd
            raise KeyboardInterrupt("stopped by the test")

    before = counter.calls
    with cancel.checking(stop_after_third_forward), pytest.raises(KeyboardInterrupt, match="stopped by the test"):
        rise.steer(tiny, problems, torch.linspace(-3, 2, 64), "resid_post.1", alphas=(0.0, 1.5),
                   settings=settings, batch_alphas=batch_alphas)
    assert counter.calls - before == 3  # three decoding steps of the first generation, of 12 a full one makes


def test_cli_stages_print_json(tmp_path):
    import typer
    from typer.testing import CliRunner

    from analyses.rise import cli as rise_cli

    app = typer.Typer()
    rise_cli.register(app)
    app.callback()(lambda: None)
    # Random models' family cuts at every word (analyses.families); sentences keep one templated step per trace.
    common = ["--model", "tiny-random:llama", "--n", "6", "--max-new-tokens", "8", "--augment", "templated",
              "--delimiter", "sentence",
              "--store", str(tmp_path / "store"), "--quiet", "--json"]
    out = CliRunner().invoke(app, ["rise", "harvest", "--layers", "0", "1", *common])  # a list after the flag
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["sites"] == {"resid_post.0": [12, 64], "resid_post.1": [12, 64]}
    out = CliRunner().invoke(app, ["rise", "analyse", "--layers", "1", "--projection", "pca",
                                   "--saes", str(tmp_path / "saes"), *common])
    assert out.exit_code == 0, out.output
    assert "resid_post.1" in json.loads(out.output)["analysis"]["silhouette_per_layer"]
    assert (tmp_path / "saes" / "resid_post.1" / "cfg.json").is_file()
    # the saved SAE is offered to other pages (the Steering page's "saved SAE feature"), with its held-out quality
    saved = rise.saved_saes("tiny-random:llama", root=tmp_path)
    layer = json.loads(out.output)["analysis"]["layers"][0]
    assert [(s.site, s.d_in, s.folder) for s in saved] == [("resid_post.1", 64, str(tmp_path / "saes" / "resid_post.1"))]
    assert saved[0].heldout_explained_variance == pytest.approx(layer["quality"]["heldout"]["explained_variance"])
    assert rise.saved_saes("smollm2-135m", root=tmp_path) == []
    # a damaged folder beside it is left out, not a traceback on every page that lists saved SAEs
    damaged = tmp_path / "saes2" / "resid_post.0"
    damaged.mkdir(parents=True)
    (damaged / "rise.json").write_text("[1, 2]")
    (damaged / "cfg.json").write_text('{"d_in": "wide"}')
    assert [s.folder for s in rise.saved_saes(root=tmp_path)] == [str(tmp_path / "saes" / "resid_post.1")]
    (damaged / "rise.json").write_text('{"model_id": "tiny-random:llama", "site": "resid_post.0"}')
    assert [s.folder for s in rise.saved_saes(root=tmp_path)] == [str(tmp_path / "saes" / "resid_post.1")]
    args = rise_cli.expand_multi_value_flags(["--alpha", "-1.5", "-1", "0,1", "--n", "4", "--layers", "6", "12"])
    assert args == ["--alpha", "-1.5", "--alpha", "-1", "--alpha", "0,1", "--n", "4", "--layers", "6", "--layers", "12"]
    assert rise_cli.numbers(["-1.5", "-1", "0,1"], "--alpha") == [-1.5, -1.0, 0.0, 1.0]


def test_bad_settings_raise_project_errors(tiny):
    with pytest.raises(BadInputError, match="out of range"):
        rise.harvest(tiny, arithmetic_problems(1), HarvestSettings(layers=(7,)))
    with pytest.raises(BadInputError, match="no problems"):
        rise.harvest(tiny, [], HarvestSettings(layers=(0,)))


@pytest.mark.model  # the organism (toy-reasoner:small, shipped weights) for eval rise-organism
@pytest.mark.parametrize("alphas, mode, says", [
    ([float("nan")], "projection", "alpha must be a finite number"),
    ([1.0, 1e9], "add", "alpha must be a finite number in [-1000000.0, 1000000.0]"),
    ([1.0], "sideways", "steering mode 'sideways' is not an option"),
    ([], "add", "give at least one alpha"),
])
def test_steering_settings_are_refused_before_the_harvest(tiny, monkeypatch, alphas, mode, says):
    """A NaN alpha or an unknown mode was said only after the harvest and the SAEs' training."""
    from analyses.rise.evaluate import evaluate_rise_organism
    from analyses.rise.pipeline import RiseOptions, RisePipeline

    ran = []
    monkeypatch.setattr(RisePipeline, "run", lambda self: ran.append(self))
    pipeline = RisePipeline(tiny, RiseOptions(n=4, layers=(1,)))
    with pytest.raises(BadInputError, match=re.escape(says)):
        pipeline.steer("reflection", alphas, 2, mode)
    with pytest.raises(BadInputError, match=re.escape(says)):
        rise.steer(tiny, arithmetic_problems(1), torch.ones(64), "resid_post.1", alphas, mode=mode)
    from probes import Engine

    with pytest.raises(BadInputError, match=re.escape(says)):
        evaluate_rise_organism(Engine.from_id("toy-reasoner:small"), n_harvest=4, n_steer=2, alphas=alphas, mode=mode)
    assert ran == []


# --------------------------------------------------------------------------- held-out quality


def test_sae_quality_is_saelens_explained_variance_and_l0():
    from analyses.rise import sae_quality
    from saes.train import SAETrainSettings, train_sae

    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(400, 16, generator=gen) @ torch.randn(16, 16, generator=gen) + 3.0
    sae, _ = train_sae(acts[:300], SAETrainSettings(d_sae=32, batch_size=64, steps=40, progress=False))
    held = acts[300:]
    q = sae_quality(sae, held)
    with torch.no_grad():
        z = sae.encode(held)
        x_hat = sae.decode(z)
    # by hand: 1 - sum ||x - x_hat||^2 / sum ||x - mean(x)||^2, and the mean count of non-zero latents
    ev = 1 - float((held - x_hat).pow(2).sum()) / float((held - held.mean(0)).pow(2).sum())
    assert q["n"] == 100 and q["explained_variance"] == pytest.approx(ev, abs=1e-4)
    assert q["l0"] == pytest.approx(float((z != 0).sum(1).float().mean()))
    assert q["mse"] == pytest.approx(float((held - x_hat).pow(2).sum(1).mean()), rel=1e-4)
    from saes.stats import sae_stats

    assert sae_stats(sae, held).explained_variance == pytest.approx(q["explained_variance"], abs=1e-4)
    # the SAE fits its own training vectors better than held-out ones
    assert sae_quality(sae, acts[:300])["explained_variance"] > q["explained_variance"]


def test_quality_warning_and_latent_auroc_by_hand():
    from analyses.rise import latent_auroc, quality_warning, step_silhouette

    assert quality_warning(0.8) is None
    assert "0.3%" in quality_warning(0.003) and "held-out" in quality_warning(0.003)
    assert "unknown" in quality_warning(float("nan"))
    # training steps: latent 1 fires only on reflection steps (AUROC 1), latent 0 is noise
    train = torch.tensor([[0.5, 2.0], [0.1, 1.5], [0.4, 0.0], [0.2, 0.0], [0.3, 0.0]])
    train_labels = ["reflection", "reflection", "other", "other", "other"]
    # held-out: latent 1 ranks one of two reflection steps below one of two others: AUROC (1 + 1 + 1 + 0) / 4
    held = torch.tensor([[0.0, 1.0], [0.0, 0.2], [0.0, 0.5], [0.0, 0.0]])
    held_labels = ["reflection", "reflection", "other", "other"]
    table = latent_auroc(train, train_labels, held, held_labels, ["reflection", "backtracking"])
    assert table["reflection"]["latent"] == 1 and table["reflection"]["train_auroc"] == 1.0
    assert table["reflection"]["heldout_auroc"] == pytest.approx(0.75)
    assert table["backtracking"]["latent"] is None and table["backtracking"]["train_positives"] == 0
    codes = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.0, 0.0]])
    assert step_silhouette(codes, ["a", "a", "b", "b", "a"]) > 0.9  # the all-zero step has no direction: left out
    assert step_silhouette(codes, ["a"] * 5) is None


# --------------------------------------------------------------------------- the organism (ground truth)


@pytest.fixture(scope="module")
def organism():
    from probes.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a width-64 model gains nothing from a second thread on a busy machine
    try:
        yield Engine.from_id("toy-reasoner:small")  # trained once (under a minute) and cached on first use
    finally:
        torch.set_num_threads(threads)


def test_the_organism_labeller_finds_every_planted_behaviour():
    from analyses.organism import organism_problems, rise_label, settling_index, step_kinds

    problems = organism_problems(200, split="eval", size="small")
    planted = [k for p in problems for k in p.meta["kinds"]]
    assert {"compute", "reflection", "backtrack", "redundant"} <= set(planted)
    for p in problems:
        assert step_kinds(p.meta["trace"]) == p.meta["kinds"]  # every planted step, in order, of the right kind
        assert settling_index(p.meta["kinds"]) == p.meta["settle_step"]
    # RISE's labels: reflection and backtracking steps are found by the organism's labeller, not by keywords
    steps = [s for p in problems for s in split_steps(p.meta["trace"], ";", include_tail=False)]
    labels = [rise_label(s.text) for s in steps]
    kinds = [k for p in problems for k in p.meta["kinds"]]
    assert labels == [{"reflection": "reflection", "backtrack": "backtracking"}.get(k, "other") for k in kinds]
    assert label_step("No , that is wrong . 3 + 4 = 7 ;") == "other"  # RISE's keywords would miss backtracking


@pytest.mark.model
def test_rise_on_the_organism_separates_behaviours_and_steering_moves_the_reflection_rate(organism, tmp_path):
    """Fails when steering does nothing: the reflection rate must move monotonically with alpha (add mode,
    h + alpha |h| w, with the reflection vector at layer 1), significantly, on the same 40 problems.

    Which way the rate moves is a property of the SAE, not of the method (docs/rise.md): measured over
    seeds 0-4 on the shipped organism (`tests/rise_seed_margins.py`, results in
    tests/data/rise_seed_margins.json), seed 0 raises reflection (0.53 -> 0.88 -> 1.23 steps per trace,
    p = 1e-4) and seeds 1-4 lower it (paired differences -0.38 to -1.93, p from 4e-7 to 0.017, every 95%
    interval clear of zero). So the test asserts a monotone move in either direction, and its thresholds sit
    outside every seed's outcome with a margin: p < 0.05 (the largest p, 0.017, is a third of it; the old
    p < 0.01 failed seed 4, and a loaded machine's run once gave 0.024 before the organism was shipped);
    the weakest held-out latent AUROC was 0.70, asserted > 0.65. The organism is the shipped file (the same
    weights on every machine) and the run is seeded on one thread, so on one machine the outcome is
    exactly reproducible (seed 0: p = 1.1e-4, +0.70 steps [0.42, 1.00])."""
    from analyses.evaluation import wilcoxon_test
    from analyses.rise.evaluate import evaluate_rise_organism

    report = evaluate_rise_organism(organism, n_harvest=300, n_steer=40, alphas=(-0.4, 0.0, 0.4), mode="add",
                                    layer=1, saes=str(tmp_path / "saes"), store=str(tmp_path / "store"), seed=0,
                                    control=False)
    d = report.to_dict()
    # sampled traces of the calibration split hold both behaviours (backtracking follows a sampled wrong step);
    # measured over seeds 0-4: reflection 180-210, backtracking 86-98
    assert d["harvest"]["label_counts"]["reflection"] >= 100 and d["harvest"]["label_counts"]["backtracking"] >= 40
    for row in d["layers"]:  # held-out steps: the SAEs reconstruct them (0.89-0.90 over the seeds)
        assert row["quality"]["heldout"]["n"] > 200 and row["quality"]["heldout"]["explained_variance"] > 0.8
    # the step vectors hold the behaviour (a linear probe finds held-out reflection steps almost perfectly: 0.99+
    # over the seeds), and one latent, chosen on the training steps, picks them out above chance (0.70-0.83)
    assert min(row["probe_auroc_kinds"]["reflection"] for row in d["layers"]) > 0.95
    assert max(row["auroc_kinds"]["reflection"]["heldout_auroc"] for row in d["layers"]) > 0.65
    rows = {r["alpha"]: r for r in d["steering"]["reflection"]["rows"]}
    assert all(r["n"] == 40 for r in rows.values())
    means = [rows[a]["mean_reflection_steps"] for a in (-0.4, 0.0, 0.4)]
    assert means == sorted(means) or means == sorted(means, reverse=True), means  # monotone in alpha
    up = wilcoxon_test([t["reflection"] for t in rows[0.4]["per_trace"]],
                       [t["reflection"] for t in rows[-0.4]["per_trace"]], lower_is_better=False)
    # the same 40 problems, paired: a significant move, its 95% interval clear of zero on one side
    assert up.p_value < 0.05 and (up.difference.low > 0 or up.difference.high < 0), up
    assert d["site"] == "resid_post.1" and d["provenance"]["command"] == "eval rise-organism"


@pytest.mark.model
def test_the_steer_command_on_the_organism_records_how_to_rebuild_it(tmp_path):
    """`thoughtscope rise steer` end to end on toy-reasoner:small: the pipeline harvests the calibration split,
    trains the SAE, steers on eval problems. At alpha 0 the steered generation is the plain one (the harvest's
    own unsteered generator gives the same traces); the provenance keeps both problem counts under the
    command's flags; a behaviour the harvest has too few steps of is a clear error."""
    import typer
    from typer.testing import CliRunner

    from analyses.organism import organism_problems
    from analyses.rise import cli as rise_cli
    from analyses.rise.harvest import generate_traces, resolve_delimiter
    from probes.engine import Engine

    app = typer.Typer()
    rise_cli.register(app)
    app.callback()(lambda: None)
    common = ["--model", "toy-reasoner:small", "--n-harvest", "60", "--n", "8", "--layers", "1", "--alpha", "0", "1",
              "--store", str(tmp_path / "store"), "--saes", str(tmp_path / "saes"), "--quiet", "--json"]
    out = CliRunner().invoke(app, ["rise", "steer", *common])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output.strip().splitlines()[-1])
    settings = got["provenance"]["settings"]
    assert (settings["n_harvest"], settings["n"], settings["alphas"], settings["mode"]) == (60, 8, [0.0, 1.0], "projection")
    assert got["provenance"]["command"] == "rise steer" and sum(got["label_counts"].values()) >= 60
    rows = got["steering"]["rows"]
    assert [r["alpha"] for r in rows] == [0.0, 1.0] and all(r["n"] == 8 for r in rows)

    engine = Engine.from_id("toy-reasoner:small")
    eval_problems = organism_problems(8, split="eval", size="small")
    assert got["steering"]["problem_ids"] == [p.id for p in eval_problems]
    plain = generate_traces(engine, eval_problems, HarvestSettings(layers=(1,), max_new_tokens=64, prompt="auto",
                                                                   labeller="auto").resolved("toy-reasoner:small"),
                            resolve_delimiter("auto", "toy-reasoner:small"))
    at_zero = rows[0]["per_trace"]
    assert [t["tokens"] for t in at_zero] == [t.n_tokens for t in plain]
    assert [t["correct"] for t in at_zero] == [t.correct for t in plain]
    assert rows[0]["examples"][0] == plain[0].text

    few = CliRunner().invoke(app, ["rise", "steer", "--behaviour", "backtracking", *common])
    assert few.exit_code != 0 and "no backtracking vector" in str(few.exception)


@pytest.mark.model  # ~20 s: umap's import and numba's first compilation
def test_the_umap_projection_of_decoder_columns_is_seeded_and_keeps_near_columns_near():
    """RISE's default map of decoder columns (UMAP, cosine metric; imported under the heavy-imports lock): the same
    seed gives the same map, and two tight groups of columns land in two separate clusters."""
    import numpy as np

    from analyses.rise.columns import _project

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(2, 16))
    w = np.concatenate([centres[0] + 0.01 * rng.normal(size=(10, 16)), centres[1] + 0.01 * rng.normal(size=(10, 16))])
    first, again = _project(w, "umap", 3, 5), _project(w, "umap", 3, 5)
    assert first.shape == (20, 2) and np.isfinite(first).all() and np.array_equal(first, again)
    a, b = first[:10], first[10:]
    within = max(np.linalg.norm(a - a.mean(0), axis=1).max(), np.linalg.norm(b - b.mean(0), axis=1).max())
    assert np.linalg.norm(a.mean(0) - b.mean(0)) > 2 * within

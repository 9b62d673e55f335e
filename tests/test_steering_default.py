"""The Steering page's defaults (analyses.steering_defaults, docs/steering_default.json) and the sweep figure.

Unit tests: the choice rule on hand-made numbers, the shipped file read back into the page's constants, a
damaged file refused, and the sweep's "unsteered" label at the dashed line's height on its log axis.
Model test: on SmolLM2 the shipped default still moves the target words, by at least the margin the
development measurement's interval gives, with the unsteered baseline unchanged.
"""

from __future__ import annotations

import json
import math

import pytest

from analyses import steering_defaults as sd
from thoughtscope.errors import BadInputError


def _row(scale, shift, ppl, distinct=0.9, words=0):
    return {"scale": scale, "target_shift": shift, "perplexity": ppl, "distinct_bigrams": distinct,
            "target_words_in_text": words, "text": ""}


def _prompt(name, rows):
    return {"prompt": name, "scales": rows}


# ----------------------------------------------------------------- the choice rule, by hand

def test_summary_and_choice_follow_the_stated_rule():
    guard = {"max_perplexity": 20.0, "min_distinct": 0.6, "min_fluent_share": 0.67}
    a = [_prompt("p1", [_row(0.1, 1.0, 3.0), _row(0.2, 3.0, 10.0, words=2), _row(0.3, 5.0, 40.0)]),
         _prompt("p2", [_row(0.1, 2.0, 4.0), _row(0.2, 4.0, 12.0, words=1), _row(0.3, 7.0, 15.0, distinct=0.3)]),
         _prompt("p3", [_row(0.1, 3.0, 5.0), _row(0.2, 5.0, 30.0, words=3), _row(0.3, 9.0, 50.0)])]
    summary = sd.summarize(a, guard)
    assert [r["target_shift_mean"] for r in summary] == [2.0, 4.0, 7.0]
    assert summary[0]["target_shift_se"] == pytest.approx(1.0 / math.sqrt(3))  # sd of 1, 2, 3 is 1
    assert [r["perplexity_median"] for r in summary] == [4.0, 12.0, 40.0]
    assert [r["fluent_share"] for r in summary] == [1.0, 2 / 3, 0.0]  # p3 too perplexed at 0.2; p2 loops at 0.3
    # 0.2 has the larger shift but 2/3 < 0.67 of the prompts fluent: 0.1 is the admissible one
    assert sd.choose([{"pair": "x", "layer": 3, "dev_summary": summary}], guard) == \
        {"pair": "x", "layer": 3, "scale": 0.1}
    # another candidate with a smaller admissible shift loses; one with a larger one wins
    other = [{"scale": 0.1, "target_shift_mean": 1.5, "fluent_share": 1.0}]
    better = [{"scale": 0.4, "target_shift_mean": 2.5, "fluent_share": 0.7}]
    cands = [{"pair": "x", "layer": 3, "dev_summary": summary}, {"pair": "y", "layer": 5, "dev_summary": other}]
    assert sd.choose(cands, guard)["pair"] == "x"
    assert sd.choose(cands + [{"pair": "z", "layer": 1, "dev_summary": better}], guard)["scale"] == 0.4
    # the prompt: fluent at the chosen scale, most target words there (p3 is not fluent at 0.2)
    assert sd.choose_prompt(a, 0.2, guard) == "p1"
    # stops: every 0.05 up to the first non-admissible scale (0.2), then 0.75, 1, 1.5; four towards B
    assert sd.slider_stops(summary, guard) == [-1.0, -0.75, -0.5, -0.25, 0.0, 0.05, 0.1, 0.15, 0.2, 0.75, 1.0, 1.5]


def test_distinct_bigrams_and_words_in_text():
    assert sd.distinct_bigrams([1, 2, 1, 2, 1, 2]) == 2 / 5  # (1,2) and (2,1) among five bigrams
    assert sd.distinct_bigrams([7]) == 1.0
    assert sd.words_in_text("The Weddings were lovely; a bride, no groom.", ("wedding", "bride", "groom")) == 3


# ----------------------------------------------------------------- the shipped file and the page

def test_the_page_opens_on_the_shipped_defaults():
    from app.views import steering

    shipped = sd.load_defaults()
    record = json.loads(sd.SHIPPED.read_text())
    assert steering.DEFAULTS_PROBLEM is None
    assert steering.SET_A.splitlines() == record["chosen"]["set_a"] and steering.PROMPT == record["chosen"]["prompt"]
    assert steering.GRID == record["chosen"]["stops"] and steering.DEFAULT_SCALE == record["chosen"]["scale"]
    assert shipped.model == record["provenance"]["model"] == "smollm2-135m"
    # the choice written in the file is the one its own measurements give under its rule
    guard = {k: record["rule"][k] for k in sd.FLUENCY}
    assert sd.choose(record["candidates"], guard) == {k: record["chosen"][k] for k in ("pair", "layer", "scale")}
    winner = next(c for c in record["candidates"]
                  if c["pair"] == shipped.pair and c["layer"] == shipped.layer)
    assert sd.slider_stops(winner["dev_summary"], guard) == list(shipped.stops)
    assert sd.choose_prompt(winner["dev"], shipped.scale, guard) == shipped.prompt
    assert set(steering.SWEEP_DEFAULT) <= set(steering.SWEEP_GRID) and shipped.scale in steering.SWEEP_DEFAULT


def test_a_damaged_defaults_file_is_refused(tmp_path):
    bad = tmp_path / "steering_default.json"
    bad.write_text('{"chosen": {"pair": "x"')
    with pytest.raises(BadInputError, match="missing or damaged"):
        sd.load_defaults(bad)
    record = json.loads(sd.SHIPPED.read_text())
    record["chosen"]["scale"] = 0.123  # not one of the stops
    bad.write_text(json.dumps(record))
    with pytest.raises(BadInputError, match="inconsistent"):
        sd.load_defaults(bad)
    with pytest.raises(BadInputError, match="missing or damaged"):
        sd.load_defaults(tmp_path / "absent.json")


# ----------------------------------------------------------------- the sweep figure's label

def test_the_unsteered_label_sits_on_the_dashed_line_of_the_log_axis():
    """Plotly places a shape on a log axis by its value and an annotation by log10 of it: the label's y
    must be log10(perplexity) for it to sit on the line (it sat at y = 2.37 read as 10**2.37 before)."""
    from app.figures.trace import FIGURES

    data = {"site": "resid_post.10", "unit": "norm", "reference_norm": 80.0, "scales": [0.1, 0.5, 1.0],
            "added_norms": [8.0, 40.0, 80.0], "perplexities": [3.0, 15.0, 300.0], "texts": ["a", "b", "c"],
            "n_tokens": [1, 1, 1], "mean_entropies": [0.0, 0.0, 0.0], "reused_tokens": [0, 0, 0],
            "unsteered_perplexity": 2.37}
    fig = FIGURES["steering_sweep"](data)  # the figure the page and the export draw
    assert fig.layout.yaxis.type == "log"
    (line,) = [s for s in fig.layout.shapes if s.y0 == s.y1]
    assert line.y0 == 2.37 and line.yref == "y"  # shapes: the value
    (label,) = [a for a in fig.layout.annotations if a.text == "unsteered"]
    assert label.yref == "y" and label.y == pytest.approx(math.log10(2.37))  # annotations: log10 of the value
    assert label.yanchor == "bottom" and label.xref == "x domain" and label.x == 0


# ----------------------------------------------------------------- the measurement holds on the model

@pytest.mark.model
def test_the_shipped_default_moves_the_target_words_on_the_embedded_model(smollm2):
    """The measurement behind the default, repeated for the shipped (pair, layer, scale) on its prompt: the
    target words' log-probability mass at the scored positions rises by more than the lower end of the
    development interval at that scale (mean - 3 standard errors over the development prompts), steering at
    scale 0 is the unsteered model exactly, and the unsteered mass is the stored one (to 0.05 nats)."""
    import torch

    from analyses.steering import diff_of_means_direction, generate_text, site_norm, steering_vector
    from probes.interventions import AddVector

    torch.set_num_threads(1)
    shipped = sd.load_defaults()
    record = json.loads(sd.SHIPPED.read_text())
    winner = next(c for c in record["candidates"] if c["pair"] == shipped.pair and c["layer"] == shipped.layer)
    dev = next(r for r in winner["dev_summary"] if r["scale"] == shipped.scale)
    margin = dev["target_shift_mean"] - 3 * dev["target_shift_se"]
    assert margin > 0.5, "the development interval itself must clear half a nat"
    stored = next(p for p in winner["dev"] if p["prompt"] == shipped.prompt)

    site = f"resid_post.{shipped.layer}"
    direction = diff_of_means_direction(smollm2, shipped.set_a, shipped.set_b, site)
    targets = sd.word_ids(smollm2, shipped.target_words)
    model_input = sd.chat_input(shipped.prompt)
    norm = site_norm(smollm2, model_input, site, chat=True)
    plain = generate_text(smollm2, model_input, max_new_tokens=sd.SCORED_POSITIONS, chat=True)
    prompt_ids = smollm2.encode(model_input, chat=True)
    ids = prompt_ids + plain.token_ids
    vector = steering_vector(direction, "norm", norm)
    base = sd.target_logmass(smollm2, ids, len(prompt_ids), targets)
    zero = sd.target_logmass(smollm2, ids, len(prompt_ids), targets, [AddVector(site, vector, 0.0)])
    steered = sd.target_logmass(smollm2, ids, len(prompt_ids), targets, [AddVector(site, vector, shipped.scale)])
    assert zero == pytest.approx(base, abs=1e-5)
    assert sum(base) / len(base) == pytest.approx(stored["unsteered_target_logmass"], abs=0.05)
    shift = sum(s - b for s, b in zip(steered, base)) / len(base)
    assert shift > margin, (shift, margin)


def test_the_rebuild_command_writes_defaults_the_page_reads(tmp_path, monkeypatch):
    """`python -m analyses.steering_defaults` end to end (the command in docs/steering_default.json's record), cut
    down to one pair, one layer, two scales and three prompts on a tiny random model, with a guard every text
    passes (a random model's texts are not fluent): the file it writes reads back as the page's defaults, and
    its numbers are the measurement's own."""
    from probes import Engine

    pair = sd.PAIRS[2]
    for name, value in (("PAIRS", (pair,)), ("LAYERS", (1,)), ("DEV_PROMPTS", sd.DEV_PROMPTS[:2]),
                        ("HELD_OUT_PROMPTS", sd.HELD_OUT_PROMPTS[:1]), ("SCALES", (0.2, 0.4)), ("MAX_NEW_TOKENS", 6),
                        ("FLUENCY", {"max_perplexity": math.inf, "min_distinct": 0.0, "min_fluent_share": 0.0})):
        monkeypatch.setattr(sd, name, value)
    out = tmp_path / "defaults.json"
    assert sd.main(["--model", "tiny-random:llama", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    defaults = sd.load_defaults(out)
    assert (defaults.model, defaults.pair, defaults.layer, defaults.target_words) == (
        "tiny-random:llama", "ocean", 1, pair.target_words)
    dev = record["candidates"][0]["dev_summary"]
    assert defaults.scale == max(dev, key=lambda r: r["target_shift_mean"])["scale"]  # every scale admissible
    assert defaults.prompt in sd.DEV_PROMPTS[:2] and 0.0 in defaults.stops and defaults.scale in defaults.stops
    assert record["provenance"]["command"].endswith("--model tiny-random:llama --out " + str(out))
    assert [p["prompt"] for p in record["held_out"]] == list(sd.HELD_OUT_PROMPTS[:1])
    # the stored numbers are the measurement's: one prompt measured again directly
    from analyses.steering import diff_of_means_direction

    engine = Engine.from_id("tiny-random:llama")
    direction = diff_of_means_direction(engine, pair.set_a, pair.set_b, "resid_post.1", "mean")
    again = sd.measure_prompt(engine, sd.HELD_OUT_PROMPTS[0], "resid_post.1", direction,
                              sd.word_ids(engine, pair.target_words), (0.2, 0.4), 6, words=pair.target_words)
    assert json.loads(json.dumps(again)) == record["held_out"][0]

"""What the neuro-fuzzy concepts page draws from a finished study: the metric table against the baselines with
the development choices, one card per rule, why a held-out sample fires the rules it does, and the overlap of
grounded words between concepts."""

from __future__ import annotations

from typing import Any

import numpy as np
import streamlit as st

from analyses.fuzzy_concepts import METHODS
from app.export import show_figure
from app.figures.fuzzy_concepts import firing_figure, metrics_figure, overlap_figure, tuning_figure

METRIC_LABELS = {"reconstruction_error": "reconstruction error", "active_concepts": "active concepts",
                 "word_overlap": "word overlap", "stability": "stability"}


# ----------------------------------------------------------------------------- 2. metrics


def metrics_section(found: dict[str, Any]) -> None:
    study, data = found["study"], found["data"]
    st.subheader("2. Metrics on held-out samples, against the baselines")
    reps = study.reps
    cols = st.columns(4)
    cols[0].metric("Samples", len(reps.samples))
    cols[1].metric("Site", reps.site)
    cols[2].metric("Train / dev / eval", " / ".join(str(len(study.splits[s])) for s in ("train", "dev", "eval")))
    chosen = study.tuning["fuzzy"].chosen
    cols[3].metric("Chosen on dev", f"m={chosen['n_features']}, \u03bb={chosen['sparsity']:g}, lr={chosen['lr']:g}")
    table = []
    for row in study.metric_table():
        shown = {"method": row["method"]}
        for name in [*METRIC_LABELS, *(k for k in row if k.startswith("ami_") and not k.endswith(("_low", "_high")))]:
            label = METRIC_LABELS.get(name, f"AMI ({name[4:]})")
            shown[label] = _interval(row[name], row[f"{name}_low"], row[f"{name}_high"])
        table.append(shown)
    st.dataframe(table, hide_index=True, key="fz_metric_table")
    figure_data = {"metric_table": data["metric_table"], "seeds": study.options.seeds, "provenance": found["provenance"]}
    show_figure(metrics_figure(figure_data), figure_data, "fuzzy_metrics")
    tests = [f"vs {m}: {t['wilcoxon']['verdict']}" for m, t in study.paired.items()]
    st.caption("Reconstruction error, paired over the evaluation samples (mean over seeds; Wilcoxon): "
               + "; ".join(tests))
    with st.expander("Development choices (tuned on the development split, never on evaluation)"):
        for method, choice in study.tuning.items():
            d = choice.to_dict()
            st.markdown(f"**{method}**: {d['objective']} \u2192 `{d['chosen']}`")
            if method == "fuzzy":
                show_figure(tuning_figure({**d, "provenance": found["provenance"]}), d, "fuzzy_tuning",
                            provenance=found["provenance"])
            st.dataframe([{**g["setting"], "dev FVU": round(g["dev_reconstruction_error"], 4),
                           "dev active": round(g["dev_active_concepts"], 3)} for g in d["grid"]],
                         hide_index=True, key=f"fz_tuning_{method}")


def _interval(mean: float | None, low: float | None, high: float | None) -> str:
    if mean is None or not np.isfinite(mean):
        return "n/a"
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


# ----------------------------------------------------------------------------- 3. rule cards


def rules_section(found: dict[str, Any]) -> None:
    study = found["study"]
    st.subheader("3. The rules (seed 0)")
    st.caption("Each rule reads all m projected features; the card shows its most distinctive clauses "
               "(centre \u00b1 width, named by where the centre sits among the training samples), the words its "
               "concept promotes through the unembedding, and the samples on which it fires most.")
    samples = study.reps.samples
    top = study.top_samples["fuzzy"]
    usage = np.bincount(study.fuzzy.transform(study.reps.Z).argmax(1).numpy(), minlength=len(study.rules))
    columns = st.columns(2)
    for rule in study.rules:
        with columns[rule.index % 2].container(border=True, key=f"fz_rule_{rule.index}"):
            st.markdown(f"**Rule {rule.index + 1}** \u00b7 strongest for {int(usage[rule.index])} samples")
            st.code(rule.text(), language=None, wrap_lines=True)
            st.markdown("**Words:** " + (", ".join(rule.words) if rule.words else "_(none survive the filter)_"))
            for i in top[rule.index][:3]:
                split = next(s for s, rows in study.splits.items() if i in rows)
                st.caption(f"{samples[i].snippet(50)}  ({split})")


# ----------------------------------------------------------------------------- 4. one sample


def sample_section(found: dict[str, Any]) -> None:
    study = found["study"]
    st.subheader("4. Why a held-out sample fires the rules it does")
    rows = study.splits["eval"]
    row = st.selectbox("Evaluation sample", rows, key="fz_sample",
                       format_func=lambda i: study.reps.samples[i].snippet(45))
    explanation = study.explain(int(row))
    data = {"firing": explanation["firing"], "memberships": explanation["memberships"],
            "chain": explanation["chain"], "snippet": study.reps.samples[int(row)].snippet(40),
            "rule_labels": [f"rule {r + 1}" for r in range(len(explanation["firing"]))],
            "provenance": found["provenance"]}
    show_figure(firing_figure(data), data, "fuzzy_firing")
    st.text(explanation["text"])
    st.caption(f"cosine(reconstruction, sample) around the training mean: {explanation['reconstruction_cosine']:.3f}")


# ----------------------------------------------------------------------------- 5. overlap


def overlap_section(found: dict[str, Any]) -> None:
    study = found["study"]
    st.subheader("5. Overlap of grounded words between concepts")
    method = st.radio("Method", METHODS, horizontal=True, key="fz_overlap_method")
    matrix = study.overlap_matrix[method]
    k = len(matrix)
    mean = float(np.sum(matrix) / (k * (k - 1))) if k > 1 else 0.0
    data = {"method": method, "overlap_matrix": matrix, "mean": mean, "words": study.words[method],
            "provenance": found["provenance"]}
    show_figure(overlap_figure(data), data, "fuzzy_overlap")
    st.dataframe([{"concept": i + 1, "words": ", ".join(w)} for i, w in enumerate(study.words[method])],
                 hide_index=True, key="fz_words")

"""What the CoT entropy page draws: a fitted calibration (densities, LLR curve, the h choice), a trace while it
streams and once finished (the exit at h, moved without regenerating), and the evaluations of early exit,
weighted voting and, on the organism, the alarm against the known settling step (each a job)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import streamlit as st

from analyses.cot_entropy import (DEFAULT_H_GRID, CotMonitor, CusumDetector, StoppingRule, analysis_from_run,
                                  evaluate_cot_exit, evaluate_cot_vote)
from analyses.cot_entropy.calibration import PageCalibration
from analyses.cot_entropy.settling import evaluate_settling
from analyses.families import ModelFamily
from analyses.organism import is_organism
from analyses.tasks import is_correct
from app import jobs
from app.export import show_figure
from app.figures.cot_entropy import answer_strip_figure, cusum_figure, entropy_curve_figure, voting_figure

SMOOTHING = 5
PAGE_NAME = "cot_entropy"


def draw_calibration(cal: PageCalibration, family: ModelFamily, task: str, n: int, n_dev: int, seed: int,
                     provenance: dict[str, Any] | None = None) -> None:
    detector, summary = cal.detector, cal.summary
    for message in summary["warnings"]:
        st.warning(message)
    cols = st.columns(4)
    cols[0].metric("Uncertain steps (f0)", detector.n_uncertain_)
    cols[1].metric("Confident steps (f1)", detector.n_confident_)
    cols[2].metric("Calibration accuracy", f"{summary['accuracy']:.0%}")
    if cal.h_choice is not None:
        cols[3].metric("h chosen on development", f"{cal.h_choice['chosen']:g}", help=cal.h_choice["objective"])
    # inline code: a regex such as [.!?](?=\s) would otherwise render as a Markdown link
    st.caption(f"Step delimiter: `{family.step_delimiter}` · answer-forcing suffix: `{family.answer_suffix!r}` · "
               f"fitted on the first {n} `{task}` problems of seed {seed} (the calibration split; the traces "
               "below are other problems)")
    show_figure(None, detector, "cot_calibration", provenance=provenance)  # from its JSON: export rebuilds it
    if cal.h_choice is not None:
        with st.expander(f"How h = {cal.h_choice['chosen']:g} was chosen on {n_dev} development problems"):
            st.dataframe([{"h": r["setting"], "accuracy": r["accuracy"], "mean generated tokens":
                           round(r["mean_generated_tokens"], 1), "exit rate": r["exit_rate"]}
                          for r in cal.h_choice["grid"]], hide_index=True, key="cot_h_choice")
            st.caption(f"Objective: {cal.h_choice['objective']}. Full traces on development: accuracy "
                       f"{cal.dev_vanilla['accuracy']:.0%}, {cal.dev_vanilla['mean_generated_tokens']:.1f}"
                       " generated tokens.")


def live_run(ctx, detector: CusumDetector, family: ModelFamily, prompt: Any, target: str | None, problem_id: str,
             h: float, run: Callable[..., Any]):
    """Generate to the end with `run` (`run_with_rule`), probing every step end; the entropy curve and CUSUM
    redraw as tokens arrive. Returns the finished trace's analysis."""
    monitor = CotMonitor(detector.with_threshold(h), family, window=SMOOTHING)
    records, probes, texts = [], [], []
    live = {"log_ratios": [], "statistic": [], "step_probe_tokens": []}
    curve_box, cusum_box = st.empty(), st.empty()
    bar = st.progress(0.0, text="generating\u2026")
    total = ctx.settings.max_new_tokens

    def view() -> dict[str, Any]:
        return {"entropies": monitor.entropies, "smoothed_entropies": monitor.smoothed, "token_texts": texts,
                "smoothing_window": SMOOTHING, "threshold": h,
                "step_ends": [[e.boundary, e.detected_at] for e in monitor.segmenter.ends], **live}

    def on_event(kind: str, item: Any) -> None:
        if kind == "token":
            records.append(item)
            texts.append(item.text)
            monitor.push(float(item.entropy), item.text)
            bar.progress(min(1.0, len(records) / total), text=f"{len(records)} tokens, {len(probes)} probes")
            curve_box.plotly_chart(entropy_curve_figure(view()), theme=None, key=f"cot-live-curve-{len(records)}")
        elif kind == "probe":
            probes.append(item)
            if item.entropies:
                live["log_ratios"].append(float(detector.log_likelihood_ratio(item.mean_entropy)))
                live["statistic"].append(monitor.observe(item.mean_entropy)[0])
                live["step_probe_tokens"].append(item.token_index)
                cusum_box.plotly_chart(cusum_figure(view()), theme=None, key=f"cot-live-cusum-{len(probes)}")

    run(ctx.backend, prompt, StoppingRule(name="probe every step", probe_step_ends=True), family=family,
        max_new_tokens=total, sampling=ctx.settings.sampling(), seed=ctx.seed, target=target,
        problem_id=problem_id, on_event=on_event)
    for box in (curve_box, cusum_box, bar):
        box.empty()
    return analysis_from_run(records, probes, detector, family, target=target, problem_id=problem_id,
                             smoothing_window=SMOOTHING)


def show_trace(analysis, h: float) -> None:
    """Metrics and figures of a finished trace at threshold h (no regeneration)."""
    data = dataclasses.replace(analysis, threshold=h).to_dict()
    probes = analysis.step_probes
    i, exit_token, n = data["alarm_step"], data["exit_token"], analysis.trace.n_tokens
    cols = st.columns(5)
    cols[0].metric("Alarm at step", "none" if i is None else f"{i + 1} of {len(probes)}")
    cols[1].metric("Exit after token", "no exit" if exit_token is None else f"{exit_token} of {n}")
    cols[2].metric("Redundant tail", f"{data['redundant_tail']} tokens",
                   help="tokens the model generated after the alarm")
    exit_answer = data["exit_answer"] if i is not None else data["final_answer"]
    verdict = "" if analysis.trace.target is None else (
        " \u2713" if is_correct(exit_answer, analysis.trace.target) else " \u2717")
    cols[3].metric("Answer emitted", f"{exit_answer or '?'}{verdict}",
                   help="the probe answer at the alarm, else the trace's final answer")
    cols[4].metric("Final answer of the trace", data["final_answer"] or "?")
    show_figure(entropy_curve_figure(data), data, "cot_entropy_curve")
    show_figure(cusum_figure(data), data, "cot_cusum")
    show_figure(answer_strip_figure(data), data, "cot_answer_strip")
    with st.expander("Trace text"):
        st.text(analysis.trace.text)


def _quiet(work: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return work()


def exit_evaluation(ctx, family: ModelFamily, task: str) -> None:
    """Early exit under the protocol: three splits, settings chosen on development, one run on evaluation."""
    st.caption(f"Three disjoint splits of `{task}`: f0/f1 are fitted on the calibration problems; the KDE "
               "bandwidth, CUSUM's h, DEER's threshold and Dynasor's k:m are each chosen on the development "
               "problems (the fewest tokens within 2 points of vanilla's development accuracy); then every method "
               "runs once on the evaluation problems. Every method replays the same greedy traces.")
    s = ctx.settings
    c1, c2, c3, c4 = st.columns(4)
    n_cal = c1.slider("Calibration problems", 1, 200, 8, key="cot_eval_ncal")
    n_dev = c2.slider("Development problems", 1, 200, 8, key="cot_eval_ndev")
    n = c3.slider("Evaluation problems", 1, 500, 8, key="cot_eval_n")
    density = c4.radio("Densities", ["kde", "histogram"], horizontal=True, key="cot_eval_density")
    left, right = st.columns([3, 1])
    h_grid = sorted(left.multiselect("CUSUM thresholds h to choose from (on development)",
                                     [0.25, 0.5, 1.0, 2.0, 4.0, 8.0], default=list(DEFAULT_H_GRID), key="cot_eval_h"))
    right.write("")
    run_exit = right.button("Run exit evaluation", key="cot_eval_run", icon=":material/play_arrow:")
    if run_exit and not h_grid:
        st.error("Choose at least one threshold h.")
        return
    key = ctx.result_key("cot-exit", task=task, n=n, n_cal=n_cal, n_dev=n_dev, h=h_grid, density=density,
                         tokens=s.max_new_tokens, seed=ctx.seed, delimiter=family.step_delimiter)
    backend, seed = ctx.backend, ctx.seed
    report = jobs.run_job(key, lambda job: _quiet(lambda: evaluate_cot_exit(
        backend, task, n, n_cal, n_dev, h_grid=h_grid, density=density, family=family, max_new_tokens=s.max_new_tokens,
        seed=seed, progress=job.progress)), label=f"Calibrating on {n_cal}, choosing on {n_dev}, evaluating on {n} "
        "problems", kind="cot-exit-evaluation", page=PAGE_NAME, start=run_exit)
    if report is None:
        return
    measure = st.radio("Tokens counted", ["generated", "with_probes"], horizontal=True,
                       key="cot_pareto_measure", format_func=lambda m: m.replace("_", " "))
    data = {**report.to_dict(with_results=False), "measure": measure}
    show_figure(None, data, "cot_pareto")
    st.dataframe(report.table(), hide_index=True, key="cot_methods")
    st.caption(report.power)
    if report.n_eval < 100:
        st.info(f"With {report.n_eval} evaluation problems the intervals are wide: read the paired tests above, "
                "not the point estimates, before calling one method better.")
    show_figure(None, data, "cot_dev_choice")


def vote_evaluation(ctx, family: ModelFamily, task: str, n_cal: int, bins: int) -> None:
    s = ctx.settings
    left, mid, right, last = st.columns(4)
    samples = left.slider("Samples per problem", 2, 16, 4, key="cot_vote_samples")
    n_vote = mid.slider("Voting problems", 1, 50, 4, key="cot_vote_n")
    temperature = right.slider("Temperature", 0.1, 1.5, 0.7, 0.05, key="cot_vote_temperature")
    last.write("")
    run_vote = last.button("Run voting", key="cot_vote_run", icon=":material/how_to_vote:")
    key = ctx.result_key("cot-vote", task=task, n=n_vote, n_cal=n_cal, samples=samples, t=temperature, bins=bins,
                         tokens=s.max_new_tokens, seed=ctx.seed, delimiter=family.step_delimiter)
    backend, seed = ctx.backend, ctx.seed
    vote = jobs.run_job(key, lambda job: _quiet(lambda: evaluate_cot_vote(
        backend, task, n_vote, n_cal, samples=samples, temperature=temperature, family=family,
        max_new_tokens=s.max_new_tokens, seed=seed, bins=bins, progress=job.progress)),
        label=f"Sampling {samples} traces for each of {n_vote} problems", kind="cot-vote", page=PAGE_NAME,
        start=run_vote)
    if vote is not None:
        show_figure(voting_figure(vote), vote, "cot_voting")
        st.caption(f"CUSUM-weighted vs majority on the same {vote.n_eval} problems: "
                   f"{vote.weighted_vs_majority['verdict']}")


def settling_evaluation(ctx, family: ModelFamily) -> None:
    """The organism: the alarm against the planted settling step (teacher-forced planted traces)."""
    st.caption("The organism's generator knows where each trace settles (the step that fixes the answer). "
               "Planted traces of its calibration, dev and eval splits are read by the model and probed at every "
               "step end; h is chosen on dev, the delay is measured on eval.")
    c1, c2, c3, c4 = st.columns(4)
    n = c1.slider("Evaluation traces", 5, 500, 40, key="cot_settle_n")
    n_other = c2.slider("Calibration and development traces (each)", 5, 300, 40, key="cot_settle_ncal")
    bound = c3.slider("On time: at most this many steps late", 0, 5, 2, key="cot_settle_bound")
    c4.write("")
    run = c4.button("Run", key="cot_settle_run", icon=":material/flag:")
    backend, seed = ctx.backend, ctx.seed
    report = jobs.run_job(ctx.result_key("cot-settling", n=n, n_other=n_other, bound=bound, seed=seed),
                          lambda job: _quiet(lambda: evaluate_settling(backend, None, n, n_other, n_other, bound=bound,
                                                                       seed=seed, family=family, progress=job.progress)),
                          label=f"Probing {n + 2 * n_other} planted traces", kind="cot-settling", page=PAGE_NAME,
                          start=run)
    if report is None:
        return
    data = report.to_dict()
    show_figure(None, data, "cot_settling")
    sm = data["summary"]
    cols = st.columns(3)
    for col, label, k in zip(cols, (f"Alarm 0..{bound} steps late", "False alarms (before settling)", "No alarm"),
                             ("within_bound", "false_alarm_rate", "miss_rate")):
        col.metric(label, f"{sm[k]['estimate']:.0%}", help=f"95% interval {sm[k]['low']:.0%} to {sm[k]['high']:.0%} "
                                                           f"over {sm['n']} evaluation traces")


def evaluation_section(ctx, family: ModelFamily, task: str, n_cal: int, bins: int) -> None:
    with st.expander("Evaluate: accuracy vs tokens against the baselines, and weighted voting"):
        exit_evaluation(ctx, family, task)
        st.divider()
        vote_evaluation(ctx, family, task, n_cal, bins)
    if is_organism(ctx.model_id):
        with st.expander("The organism: CUSUM alarm vs the known settling step"):
            settling_evaluation(ctx, family)

"""CoT entropy phases (Xu et al.): calibrate the CUSUM detector, watch a trace's entropy live, move the
exit with h on the finished trace, and evaluate early exit and weighted voting against the baselines
under the evaluation protocol (settings chosen on a development split, each method run once on the
evaluation split, 95% intervals and paired tests); on the `toy-reasoner` organism, the alarm against
the known settling step. Every figure names the split it comes from.

The computations live in `analyses.cot_entropy`; this page reads widgets, calls them and draws.
Results (fitted detectors, finished traces, evaluations) are kept per process in `results()`, keyed
by everything they depend on, so moving h or reopening the page never regenerates anything.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import streamlit as st

from analyses.cot_entropy import (DEFAULT_H_GRID, CotMonitor, CusumDetector, StoppingRule, analysis_from_run,
                                  calibration_summary, evaluate_cot_exit, evaluate_cot_vote, fit_detector,
                                  run_with_rule)
from analyses.families import ModelFamily, default_task, family_for
from analyses.organism import is_organism
from analyses.tasks import TASK_NAMES, is_correct, load_task
from app.context import FinishedGenerations
from app.export import show_figure
from app.figures.cot_entropy import answer_strip_figure, cusum_figure, entropy_curve_figure, voting_figure
from app.registry import PageSpec
from thoughtscope.errors import ThoughtscopeError

PAGE = PageSpec("CoT entropy phases", ":material/ssid_chart:", 30, requires=("generate", "fork"))

FROM_SIDEBAR = "the sidebar prompt"
FROM_TASK = "a held-out task problem"
SMOOTHING = 5
CAL_BATCH = 4  # calibration traces per batch (one progress tick each)
H_MIN, H_MAX = 0.1, 10.0


@st.cache_resource
def results() -> FinishedGenerations:
    """Fitted detectors, finished traces and evaluations of this process, newest 64 kept."""
    return FinishedGenerations(max_entries=64)


def fit_calibration(engine: Any, problems: list, family: ModelFamily, *, max_new_tokens: int, bins: int, seed: int,
                    density: str = "kde",
                    on_progress: Callable[[int, int], None] | None = None) -> tuple[CusumDetector, dict[str, Any]]:
    """`fit_detector` batch by batch (so the page can show progress), its summary and any warnings of the fit."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        detector, traces = fit_detector(engine, problems, family, density=density, bins=bins,
                                        max_new_tokens=max_new_tokens, seed=seed, batch_size=CAL_BATCH,
                                        on_progress=on_progress)
    return detector, {**calibration_summary(traces), "warnings": [str(w.message) for w in caught]}


# ----------------------------------------------------------------------------- 1. calibration


def calibration_section(ctx, store, family: ModelFamily, task: str, force: bool):
    """The fitted detector (fitting it now if asked, or if `force`), its densities and LLR curve."""
    st.subheader("1. Calibration")
    left, mid, right, last = st.columns(4)
    n = left.slider("Calibration problems", 2, 100, 12, key="cot_n_cal",
                    help="the paper uses 100; a small n keeps the CPU quick")
    density = mid.radio("Densities f0/f1", ["kde", "histogram"], horizontal=True, key="cot_density",
                        help="kde: Gaussian kernels (Silverman's bandwidth here; the evaluation below chooses it on "
                             "a development split); histogram: the paper's, which quantises log f1/f0")
    bins = right.slider("Histogram bins", 2, 30, 10, key="cot_bins", disabled=density != "histogram")
    last.write("")
    fit_now = last.button("Calibrate", key="cot_calibrate", icon=":material/tune:")
    s = ctx.settings
    key = ctx.result_key("calibration", task=task, n=n, bins=bins, density=density, tokens=s.max_new_tokens,
                         seed=ctx.seed, delimiter=family.step_delimiter)
    found = store.get(key)
    if found is None and (fit_now or force):
        problems = load_task(task, n, seed=ctx.seed, split="calibration")
        with st.status(f"Calibrating on {n} {task} problems (greedy, {s.max_new_tokens} tokens each)\u2026",
                       expanded=True) as status:
            bar = st.progress(0.0, text="generating and probing\u2026")
            found = fit_calibration(ctx.backend, problems, family, max_new_tokens=s.max_new_tokens, bins=bins,
                                    seed=ctx.seed, density=density, on_progress=lambda done, total: bar.progress(
                                        done / total, text=f"{done}/{total} traces probed"))
            status.update(label=f"Calibrated on {n} problems", state="complete", expanded=False)
        store.put(key, found)
    if found is None:
        st.info("Press **Calibrate** to fit the uncertainty (f0) and confidence (f1) densities of probe-answer "
                "entropy on held-out problems (Generate below calibrates first if needed).")
        return None, n, key
    detector, summary = found
    for message in summary["warnings"]:
        st.warning(message)
    cols = st.columns(3)
    cols[0].metric("Uncertain steps (f0)", detector.n_uncertain_)
    cols[1].metric("Confident steps (f1)", detector.n_confident_)
    cols[2].metric("Calibration accuracy", f"{summary['accuracy']:.0%}")
    # inline code: a regex such as [.!?](?=\s) would otherwise render as a Markdown link
    st.caption(f"Step delimiter: `{family.step_delimiter}` · answer-forcing suffix: `{family.answer_suffix!r}` · "
               f"fitted on the first {n} `{task}` problems of seed {ctx.seed} (the calibration split; the traces "
               "below are other problems)")
    show_figure(None, detector, "cot_calibration")  # drawn from its JSON: export rebuilds it exactly
    return detector, n, key


# ----------------------------------------------------------------------------- 2. live trace


def held_out_problems(task: str, n_cal: int, seed: int, k: int = 8) -> list:
    """`k` problems of the task that the calibration (the first `n_cal` of this seed) did not use
    (the organism's: its eval split, disjoint from its calibration split by construction)."""
    if is_organism(task):
        return load_task(task, k, seed=seed, split="eval")
    calibration = load_task(task, n_cal, seed=seed)
    used = {p.id for p in calibration} | {p.question for p in calibration}
    return [p for p in load_task(task, n_cal + k, seed=seed) if p.id not in used and p.question not in used][:k]


def pick_input(ctx, task: str, n_cal: int) -> tuple[Any, str | None, str]:
    """(prompt for run_with_rule, known answer or None, an id) from the chosen source."""
    source = st.radio("Generate for", [FROM_SIDEBAR, FROM_TASK], horizontal=True, key="cot_source")
    if source == FROM_TASK:
        problems = held_out_problems(task, n_cal, ctx.seed)
        problem = st.selectbox("Problem", problems, key=f"cot_problem_{task}",
                               format_func=lambda p: f"{p.id}: {p.question[:90]}")
        st.caption(f"{problem.question}  \nanswer: **{problem.answer}**")
        return problem, problem.answer, problem.id
    target = st.text_input("Known answer (optional: marks intermediate answers correct/incorrect)",
                           key="cot_target").strip() or None
    if not ctx.chat:
        st.caption("The prompt is sent through the chat template (the probes force an answer after it).")
    return ctx.model_input(), target, ""


def live_run(ctx, detector: CusumDetector, family: ModelFamily, prompt: Any, target: str | None, problem_id: str,
             h: float):
    """Generate to the end, probing every step end; the entropy curve and CUSUM redraw as tokens arrive."""
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

    run_with_rule(ctx.backend, prompt, StoppingRule(name="probe every step", probe_step_ends=True), family=family,
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


def trace_section(ctx, store, family: ModelFamily, task: str, n_cal: int, detector: CusumDetector | None,
                  calibration_key: str, generate: bool) -> None:
    st.subheader("2. A trace, live")
    prompt, target, problem_id = pick_input(ctx, task, n_cal)
    h = st.slider("Threshold h = log \u03b3 (moves the exit on the finished trace, no regeneration)", H_MIN, H_MAX,
                  2.0, 0.1, key="cot_h")
    st.button("Generate", type="primary", key="cot_generate", icon=":material/play_arrow:",
              help="streams the trace to its end with a probe at every step end (calibrates first if needed)")
    if detector is None:
        return
    s = ctx.settings
    key = ctx.result_key("trace", calibration=calibration_key, prompt=prompt, target=target, settings=s.to_dict(),
                         seed=ctx.seed, delimiter=family.step_delimiter)
    analysis = store.get(key)
    if generate:
        analysis = live_run(ctx, detector, family, prompt, target, problem_id, h)
        store.put(key, analysis)
    if analysis is None:
        st.info("Press **Generate** to stream a trace with a probe at every step end.")
        return
    st.subheader("3. The exit at h")
    show_trace(analysis, h)


# ----------------------------------------------------------------------------- 4. evaluation


def exit_evaluation(ctx, store, family: ModelFamily, task: str) -> None:
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
    h_grid = left.multiselect("CUSUM thresholds h to choose from (on development)", [0.25, 0.5, 1.0, 2.0, 4.0, 8.0],
                              default=list(DEFAULT_H_GRID), key="cot_eval_h")
    right.write("")
    run_exit = right.button("Run exit evaluation", key="cot_eval_run", icon=":material/play_arrow:")
    key = ctx.result_key("cot-exit", task=task, n=n, n_cal=n_cal, n_dev=n_dev, h=sorted(h_grid), density=density,
                         tokens=s.max_new_tokens, seed=ctx.seed, delimiter=family.step_delimiter)
    report = store.get(key)
    if run_exit:
        if not h_grid:
            st.error("Choose at least one threshold h.")
            return
        with st.status(f"Calibrating on {n_cal}, choosing on {n_dev}, evaluating on {n} problems\u2026",
                       expanded=True) as status, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bar = st.progress(0.0, text="calibration\u2026")
            report = evaluate_cot_exit(ctx.backend, task, n, n_cal, n_dev, h_grid=sorted(h_grid), density=density,
                                       family=family, max_new_tokens=s.max_new_tokens, seed=ctx.seed,
                                       progress=lambda stage, done, total: bar.progress(
                                           done / total, text=f"{stage}: {done}/{total} traces"))
            status.update(label=f"Evaluated on {n} problems", state="complete", expanded=False)
        store.put(key, report)
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


def settling_evaluation(ctx, store, family: ModelFamily) -> None:
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
    key = ctx.result_key("cot-settling", n=n, n_other=n_other, bound=bound, seed=ctx.seed)
    report = store.get(key)
    if run:
        from analyses.cot_entropy.settling import evaluate_settling

        with st.spinner(f"Probing {n + 2 * n_other} planted traces\u2026"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = evaluate_settling(ctx.backend, None, n, n_other, n_other, bound=bound, seed=ctx.seed,
                                       family=family)
        store.put(key, report)
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


def evaluation_section(ctx, store, family: ModelFamily, task: str, n_cal: int, bins: int) -> None:
    with st.expander("Evaluate: accuracy vs tokens against the baselines, and weighted voting"):
        exit_evaluation(ctx, store, family, task)
        st.divider()
        s = ctx.settings
        left, mid, right, last = st.columns(4)
        samples = left.slider("Samples per problem", 2, 16, 4, key="cot_vote_samples")
        n_vote = mid.slider("Voting problems", 1, 50, 4, key="cot_vote_n")
        temperature = right.slider("Temperature", 0.1, 1.5, 0.7, 0.05, key="cot_vote_temperature")
        last.write("")
        run_vote = last.button("Run voting", key="cot_vote_run", icon=":material/how_to_vote:")
        vote_key = ctx.result_key("cot-vote", task=task, n=n_vote, n_cal=n_cal, samples=samples, t=temperature,
                                  bins=bins, tokens=s.max_new_tokens, seed=ctx.seed, delimiter=family.step_delimiter)
        vote = store.get(vote_key)
        if run_vote:
            with st.spinner(f"Sampling {samples} traces for each of {n_vote} problems\u2026"), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                vote = evaluate_cot_vote(ctx.backend, task, n_vote, n_cal, samples=samples, temperature=temperature,
                                         family=family, max_new_tokens=s.max_new_tokens, seed=ctx.seed, bins=bins)
            store.put(vote_key, vote)
        if vote is not None:
            show_figure(voting_figure(vote), vote, "cot_voting")
            st.caption(f"CUSUM-weighted vs majority on the same {vote.n_eval} problems: "
                       f"{vote.weighted_vs_majority['verdict']}")
    if is_organism(ctx.model_id):
        with st.expander("The organism: CUSUM alarm vs the known settling step"):
            settling_evaluation(ctx, store, family)


# ----------------------------------------------------------------------------- the page


def render(ctx) -> None:
    st.title("CoT entropy phases")
    st.caption("Xu et al.: a probe forces the intermediate answer at every step end; its entropy falls from an "
               "uncertainty to a confidence regime, and a CUSUM test on log f1/f0 raises the alarm where thinking "
               "could stop.")
    store = results()
    left, right = st.columns([1, 2])
    own = default_task(ctx.model_id)
    tasks = [own] + [t for t in TASK_NAMES if t != own]
    task = left.selectbox("Task (calibration and evaluation problems)", tasks, key="cot_task")
    delimiter = right.text_input("Step delimiter (regex; empty: the model family's)", key="cot_delimiter",
                                 placeholder=family_for(ctx.model_id).step_delimiter)
    family = family_for(ctx.model_id).with_delimiter(delimiter.strip() or None)
    generate = st.session_state.get("cot_generate", False)  # Generate (below) calibrates first when needed
    try:
        detector, n_cal, calibration_key = calibration_section(ctx, store, family, task, force=generate)
    except ThoughtscopeError as err:
        st.error(str(err))
        detector, n_cal, calibration_key = None, st.session_state.get("cot_n_cal", 12), ""
    try:
        trace_section(ctx, store, family, task, n_cal, detector, calibration_key, generate and detector is not None)
    except ThoughtscopeError as err:
        st.error(str(err))
    try:
        evaluation_section(ctx, store, family, task, n_cal, st.session_state.get("cot_bins", 10))
    except ThoughtscopeError as err:
        st.error(str(err))

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
import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import streamlit as st

from analyses.cot_entropy import (DEFAULT_H_GRID, CotMonitor, CusumDetector, StoppingRule, analysis_from_run,
                                  evaluate_cot_exit, evaluate_cot_vote, run_with_rule)
from analyses.cot_entropy import ship as cot_ship
from analyses.cot_entropy.calibration import PageCalibration, calibrate, held_out_problems
from analyses.families import ModelFamily, default_task, family_for
from analyses.organism import is_organism
from analyses.tasks import TASK_NAMES, is_correct, known_answer
from app import jobs
from app.context import FinishedGenerations
from app.export import show_figure
from app.figures.cot_entropy import answer_strip_figure, cusum_figure, entropy_curve_figure, voting_figure
from app.registry import PageSpec
from thoughtscope import shipped
from thoughtscope.errors import ThoughtscopeError

PAGE = PageSpec("CoT entropy phases", ":material/ssid_chart:", 30, requires=("generate", "fork"))

FROM_SIDEBAR = "the sidebar prompt"
FROM_TASK = "a held-out task problem"
SMOOTHING = 5
CAL_BATCH = 4  # calibration traces per batch (one progress tick each)
H_MIN, H_MAX = 0.1, 10.0


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


@st.cache_resource
def results() -> FinishedGenerations:
    """Fitted detectors, finished traces and evaluations of this process, newest 64 kept."""
    return FinishedGenerations(max_entries=64)


# ----------------------------------------------------------------------------- 1. calibration


@dataclass
class Calibrated:
    """What the page draws from: the detector (its threshold: h chosen on development, when one was),
    the summary, and where it came from (a stored result's label, or this process' job)."""

    detector: CusumDetector
    summary: dict[str, Any]
    h_choice: dict[str, Any] | None = None
    dev_vanilla: dict[str, float] | None = None
    source: str = ""


def _from_page_calibration(cal: PageCalibration, source: str) -> Calibrated:
    return Calibrated(cal.detector, cal.summary, cal.h_choice, cal.dev_vanilla, source)


def shipped_calibration(ctx, settings: dict[str, Any]) -> tuple[Calibrated | None, str | None, bool]:
    """(the stored calibration when it was made with `settings`, a note for the page, damaged?)."""
    found = shipped.find(cot_ship.NAME, ctx.model_id, ctx.backend.info().get("fingerprint"))
    if not found:
        return None, (found.reason if found.damaged else None), found.damaged
    data = found.json(cot_ship.FILE)
    stored = {k: data["settings"].get(k) for k in settings}
    if stored != settings:
        other = ", ".join(f"{k} {stored[k]!r}" for k in settings if stored[k] != settings[k])
        return None, (f"A stored calibration ships for {ctx.model_id}, made with other settings ({other}); "
                      "press **Calibrate** to run one with yours."), False
    digest = found.manifest["files"][cot_ship.FILE]
    cached = results().get(f"shipped-calibration-{digest}")
    if cached is None:
        cached = _from_page_calibration(PageCalibration.from_json(data), found.label())
        results().put(f"shipped-calibration-{digest}", cached)
    return cached, None, False


def calibration_section(ctx, family: ModelFamily, task: str, force: bool) -> tuple[Calibrated | None, int]:
    """The detector: the stored one when the settings match it, else this process' job (started by
    Calibrate, or by Generate when nothing is calibrated yet); its densities, LLR curve and h choice."""
    st.subheader("1. Calibration")
    c1, c2, c3, c4, c5 = st.columns(5)
    n = c1.slider("Calibration problems", 2, 100, cot_ship.DEFAULTS["n_calibration"], key="cot_n_cal",
                  help="the paper uses 100; a small n keeps the CPU quick")
    n_dev = c2.slider("Development problems (choose h)", 1, 100, cot_ship.DEFAULTS["n_development"],
                      key="cot_n_dev", help="h is chosen on these: the fewest generated tokens within 2 points of "
                                            "the full traces' accuracy (the evaluation harness' objective)")
    density = c3.radio("Densities f0/f1", ["kde", "histogram"], horizontal=True, key="cot_density",
                       help="kde: Gaussian kernels (Silverman's bandwidth here; the evaluation below chooses it on "
                            "a development split); histogram: the paper's, which quantises log f1/f0")
    bins = c4.slider("Histogram bins", 2, 30, cot_ship.DEFAULTS["bins"], key="cot_bins",
                     disabled=density != "histogram")
    c5.write("")
    fit_now = c5.button("Calibrate", key="cot_calibrate", icon=":material/tune:",
                        help="runs as a job: progress, time left, Stop")
    fit_now = fit_now or bool(st.session_state.get("cot_calibrate_again"))  # "Run again" (drawn below)
    s = ctx.settings
    settings = {"task": task, "n_calibration": n, "n_development": n_dev, "max_new_tokens": s.max_new_tokens,
                "seed": ctx.seed, "density": density, "bins": bins, "delimiter": family.step_delimiter}
    key = ctx.result_key("calibration", **settings)
    stored, note, damaged = shipped_calibration(ctx, settings)
    if damaged:
        st.warning(f"{note} Press **Calibrate** to rebuild it here.", icon=":material/broken_image:")
    elif note and jobs.registry().for_key(key) is None:
        st.info(note, icon=":material/info:")
    calibrated = None
    if stored is not None and not fit_now and jobs.registry().for_key(key) is None:
        calibrated = stored
    else:
        backend = ctx.backend

        def work(job: jobs.Job) -> Calibrated:
            cal = calibrate(backend, task, family, n_calibration=n, n_development=n_dev,
                            max_new_tokens=s.max_new_tokens, seed=ctx.seed, density=density, bins=bins,
                            batch_size=CAL_BATCH, on_progress=job.progress)
            return _from_page_calibration(cal, "")

        calibrated = jobs.run_job(key, work, label=f"Calibrating on {n} {task} problems and choosing h on {n_dev}",
                                  kind="cot-calibration", page="cot_entropy",
                                  start=fit_now or (force and stored is None))
    if calibrated is None:
        if jobs.registry().for_key(key) is None:
            st.info("Press **Calibrate** to fit the uncertainty (f0) and confidence (f1) densities of probe-answer "
                    "entropy on held-out problems and choose h on development problems (Generate below calibrates "
                    "first if needed).")
        return None, n
    detector, summary = calibrated.detector, calibrated.summary
    if calibrated.source:
        left, right = st.columns([4, 1])
        left.caption(calibrated.source)
        right.button("Run again", key="cot_calibrate_again", icon=":material/refresh:",
                     help="calibrate with these settings here, as a job (the stored result stays on disk)")
    for message in summary["warnings"]:
        st.warning(message)
    cols = st.columns(4)
    cols[0].metric("Uncertain steps (f0)", detector.n_uncertain_)
    cols[1].metric("Confident steps (f1)", detector.n_confident_)
    cols[2].metric("Calibration accuracy", f"{summary['accuracy']:.0%}")
    if calibrated.h_choice is not None:
        cols[3].metric("h chosen on development", f"{calibrated.h_choice['chosen']:g}",
                       help=calibrated.h_choice["objective"])
    # inline code: a regex such as [.!?](?=\s) would otherwise render as a Markdown link
    st.caption(f"Step delimiter: `{family.step_delimiter}` · answer-forcing suffix: `{family.answer_suffix!r}` · "
               f"fitted on the first {n} `{task}` problems of seed {ctx.seed} (the calibration split; the traces "
               "below are other problems)")
    show_figure(None, detector, "cot_calibration")  # drawn from its JSON: export rebuilds it exactly
    if calibrated.h_choice is not None:
        with st.expander(f"How h = {calibrated.h_choice['chosen']:g} was chosen on {n_dev} development problems"):
            st.dataframe([{"h": r["setting"], "accuracy": r["accuracy"], "mean generated tokens":
                           round(r["mean_generated_tokens"], 1), "exit rate": r["exit_rate"]}
                          for r in calibrated.h_choice["grid"]], hide_index=True, key="cot_h_choice")
            st.caption(f"Objective: {calibrated.h_choice['objective']}. Full traces on development: accuracy "
                       f"{calibrated.dev_vanilla['accuracy']:.0%}, {calibrated.dev_vanilla['mean_generated_tokens']:.1f}"
                       " generated tokens.")
    return calibrated, n


# ----------------------------------------------------------------------------- 2. live trace


def pick_input(ctx, task: str, n_cal: int) -> tuple[Any, str | None, str]:
    """(prompt for run_with_rule, known answer or None, an id) from the chosen source."""
    source = st.radio("Generate for", [FROM_SIDEBAR, FROM_TASK], horizontal=True, key="cot_source")
    if source == FROM_TASK:
        problems = held_out_problems(task, n_cal, ctx.seed)
        problem = st.selectbox("Problem", problems, key=f"cot_problem_{task}",
                               format_func=lambda p: f"{p.id}: {p.question[:90]}")
        st.caption(f"{problem.question}  \nanswer: **{problem.answer}**")
        return problem, problem.answer, problem.id
    known = known_answer(ctx.prompt)  # the task generator's answer when the prompt is one of its problems
    typed = st.text_input("Known answer (marks intermediate answers correct/incorrect)", key="cot_target",
                          placeholder=f"{known} (the task's answer to this problem)" if known else "optional",
                          help="empty: the task generator's answer when the sidebar prompt is one of its problems")
    target = typed.strip() or known
    if target is not None and not typed.strip():
        st.caption(f"Known answer **{known}**: the sidebar prompt is a task problem, answered by its generator.")
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


def trace_section(ctx, store, family: ModelFamily, task: str, n_cal: int, calibrated: Calibrated | None,
                  generate: bool) -> None:
    st.subheader("2. A trace, live")
    prompt, target, problem_id = pick_input(ctx, task, n_cal)
    st.button("Generate", type="primary", key="cot_generate", icon=":material/play_arrow:",
              help="streams the trace to its end with a probe at every step end (calibrates first if needed)")
    if calibrated is None:
        if generate:
            st.info("Calibrating first (above); press **Generate** again once it is done.")
        return
    detector = calibrated.detector
    default_h = float(min(H_MAX, max(H_MIN, detector.threshold)))
    h = st.slider("Threshold h = log \u03b3 (moves the exit on the finished trace, no regeneration)", H_MIN, H_MAX,
                  default_h, 0.05, key="cot_h",
                  help=f"default {default_h:g}: " + ("chosen on the development problems (calibration above)"
                                                      if calibrated.h_choice else "the detector's"))
    s = ctx.settings
    key = ctx.result_key("trace", calibration=_digest(detector.to_dict()), prompt=prompt, target=target,
                         settings=s.to_dict(), seed=ctx.seed, delimiter=family.step_delimiter)
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
    if run_exit and not h_grid:
        st.error("Choose at least one threshold h.")
        return
    backend = ctx.backend

    def work(job: jobs.Job):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return evaluate_cot_exit(backend, task, n, n_cal, n_dev, h_grid=sorted(h_grid), density=density,
                                     family=family, max_new_tokens=s.max_new_tokens, seed=ctx.seed,
                                     progress=job.progress)

    report = jobs.run_job(key, work, label=f"Calibrating on {n_cal}, choosing on {n_dev}, evaluating on {n} problems",
                          kind="cot-exit-evaluation", page="cot_entropy", start=run_exit)
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
    backend = ctx.backend

    def work(job: jobs.Job):
        from analyses.cot_entropy.settling import evaluate_settling

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return evaluate_settling(backend, None, n, n_other, n_other, bound=bound, seed=ctx.seed, family=family,
                                     progress=job.progress)

    report = jobs.run_job(key, work, label=f"Probing {n + 2 * n_other} planted traces", kind="cot-settling",
                          page="cot_entropy", start=run)
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
        backend = ctx.backend

        def vote_work(job: jobs.Job):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return evaluate_cot_vote(backend, task, n_vote, n_cal, samples=samples, temperature=temperature,
                                         family=family, max_new_tokens=s.max_new_tokens, seed=ctx.seed, bins=bins,
                                         progress=job.progress)

        vote = jobs.run_job(vote_key, vote_work, label=f"Sampling {samples} traces for each of {n_vote} problems",
                            kind="cot-vote", page="cot_entropy", start=run_vote)
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
        calibrated, n_cal = calibration_section(ctx, family, task, force=generate)
    except ThoughtscopeError as err:
        st.error(str(err))
        calibrated, n_cal = None, st.session_state.get("cot_n_cal", cot_ship.DEFAULTS["n_calibration"])
    try:
        trace_section(ctx, store, family, task, n_cal, calibrated, generate)
    except ThoughtscopeError as err:
        st.error(str(err))
    try:
        evaluation_section(ctx, store, family, task, n_cal, st.session_state.get("cot_bins", 10))
    except ThoughtscopeError as err:
        st.error(str(err))

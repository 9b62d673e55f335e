"""CoT entropy phases (Xu et al.): calibrate the CUSUM detector, watch a trace's entropy live, move the
exit with h on the finished trace, and evaluate early exit and weighted voting against the baselines
under the evaluation protocol (settings chosen on a development split, each method run once on the
evaluation split, 95% intervals and paired tests); on the `toy-reasoner` organism, the alarm against
the known settling step. Every figure names the split it comes from.

The computations live in `analyses.cot_entropy`; this page reads widgets, calls them and draws
(`app.sections.cot_entropy` holds the drawing and the evaluations). Results are kept by everything they
depend on (`app.jobs` for the calibration and the evaluations, `app.context.compute` for a streamed trace),
so moving h or reopening the page never regenerates anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import streamlit as st

from analyses.cot_entropy import run_with_rule
from analyses.cot_entropy import ship as cot_ship
from analyses.cot_entropy.calibration import PageCalibration, calibrate, held_out_problems
from analyses.families import ModelFamily, default_task, family_for
from analyses.tasks import known_answer
from app import jobs
from app.context import compute, shows_errors
from app.export import page_provenance, run_summary
from app.registry import PageSpec
from app.sections.cot_entropy import draw_calibration, evaluation_section, live_run, show_trace
from app.sections.tasks import task_picker
from thoughtscope import shipped

PAGE = PageSpec("CoT entropy phases", ":material/ssid_chart:", 30, requires=("generate", "fork"))

FROM_SIDEBAR = "the sidebar prompt"
FROM_TASK = "a held-out task problem"
CAL_BATCH = 4  # calibration traces per batch (one progress tick each)
H_MIN, H_MAX = 0.1, 10.0


@st.cache_resource(show_spinner=False, max_entries=4)
def _stored_calibration(folder: str, digest: str) -> PageCalibration:
    """A verified shipped calibration, fitted from its JSON once per process (`digest`: the file's sha256)."""
    return PageCalibration.from_json(json.loads((Path(folder) / cot_ship.FILE).read_text()))


def shipped_calibration(ctx, settings: dict[str, Any]) -> tuple[PageCalibration | None, str, str | None, bool,
                                                                 dict[str, Any] | None]:
    """(the stored calibration when it was made with `settings`, its label, a note for the page, damaged?, its
    provenance record)."""
    found = shipped.find(cot_ship.NAME, ctx.model_id, ctx.backend.info().get("fingerprint"))
    if not found:
        return None, "", (found.reason if found.damaged else None), found.damaged, None
    made_with = {k: found.json(cot_ship.FILE)["settings"].get(k) for k in settings}
    if made_with != settings:
        other = ", ".join(f"{k} {made_with[k]!r}" for k in settings if made_with[k] != settings[k])
        return None, "", (f"A stored calibration ships for {ctx.model_id}, made with other settings ({other}); "
                          "press **Calibrate** to run one with yours."), False, None
    return (_stored_calibration(str(found.folder), found.manifest["files"][cot_ship.FILE]), found.label(), None, False,
            found.provenance)


def calibration_section(ctx, family: ModelFamily, task: str,
                        force: bool) -> tuple[PageCalibration | None, int, dict[str, Any] | None]:
    """The detector: the stored one when the settings match it, else this process' job (started by
    Calibrate, or by Generate when nothing is calibrated yet); its densities, LLR curve and h choice. Returns
    (the detector or None, the calibration problems, the record of the run that made the detector)."""
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
    stored, source, note, damaged, stored_record = shipped_calibration(ctx, settings)
    if damaged:
        st.warning(f"{note} Press **Calibrate** to rebuild it here.", icon=":material/broken_image:")
    elif note and jobs.registry().for_key(key) is None:
        st.info(note, icon=":material/info:")
    # the figure's export names what made it: the stored calibration's record, or this page's run with `settings`
    record = ctx.provenance(settings={"calibration": settings}, data=task, split="calibration")
    if stored is not None and not fit_now and jobs.registry().for_key(key) is None:
        cal, record = stored, stored_record
    else:
        backend, seed, source = ctx.backend, ctx.seed, ""
        cal = jobs.run_job(key, lambda job: calibrate(backend, task, family, n_calibration=n, n_development=n_dev,
                                                      max_new_tokens=s.max_new_tokens, seed=seed, density=density,
                                                      bins=bins, batch_size=CAL_BATCH, on_progress=job.progress),
                           label=f"Calibrating on {n} {task} problems and choosing h on {n_dev}",
                           kind="cot-calibration", page="cot_entropy", start=fit_now or (force and stored is None))
    if cal is None:
        if jobs.registry().for_key(key) is None:
            st.info("Press **Calibrate** to fit the uncertainty (f0) and confidence (f1) densities of probe-answer "
                    "entropy on held-out problems and choose h on development problems (Generate below calibrates "
                    "first if needed).")
        return None, n, None
    if source:
        left, right = st.columns([4, 1])
        left.caption(source)
        right.button("Run again", key="cot_calibrate_again", icon=":material/refresh:",
                     help="calibrate with these settings here, as a job (the stored result stays on disk)")
    draw_calibration(cal, family, task, n, n_dev, ctx.seed, provenance=record)
    return cal, n, record


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


def trace_section(ctx, family: ModelFamily, task: str, n_cal: int, cal: PageCalibration | None,
                  generate: bool) -> None:
    st.subheader("2. A trace, live")
    prompt, target, problem_id = pick_input(ctx, task, n_cal)
    st.button("Generate", type="primary", key="cot_generate", icon=":material/play_arrow:",
              help="streams the trace to its end with a probe at every step end (calibrates first if needed)")
    if cal is None:
        if generate:
            st.info("Calibrating first (above); press **Generate** again once it is done.")
        return
    detector = cal.detector
    default_h = float(min(H_MAX, max(H_MIN, detector.threshold)))
    h = st.slider("Threshold h = log \u03b3 (moves the exit on the finished trace, no regeneration)", H_MIN, H_MAX,
                  default_h, 0.05, key="cot_h",
                  help=f"default {default_h:g}: " + ("chosen on the development problems (calibration above)"
                                                      if cal.h_choice else "the detector's"))
    digest = hashlib.sha256(json.dumps(detector.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
    key = ctx.result_key("trace", calibration=digest, prompt=prompt, target=target, settings=ctx.settings.to_dict(),
                         seed=ctx.seed, delimiter=family.step_delimiter)
    analysis = compute(key, lambda: live_run(ctx, detector, family, prompt, target, problem_id, h, run_with_rule),
                       start=generate, again=generate, spinner=None, kind="cot-trace", page="cot_entropy")
    if analysis is None:
        st.info("Press **Generate** to stream a trace with a probe at every step end.")
        return
    st.subheader("3. The exit at h")
    show_trace(analysis, h)


def render(ctx) -> None:
    st.title("CoT entropy phases")
    st.caption("Xu et al.: a probe forces the intermediate answer at every step end; its entropy falls from an "
               "uncertainty to a confidence regime, and a CUSUM test on log f1/f0 raises the alarm where thinking "
               "could stop.")
    left, right = st.columns([1, 2])
    own = default_task(ctx.model_id)
    task = task_picker(left, "Task (calibration and evaluation problems)", own, "cot_task")
    delimiter = right.text_input("Step delimiter (regex; empty: the model family's)", key="cot_delimiter",
                                 placeholder=family_for(ctx.model_id).step_delimiter)
    family = family_for(ctx.model_id).with_delimiter(delimiter.strip() or None)
    generate = st.session_state.get("cot_generate", False)  # Generate (below) calibrates first when needed
    cal, n_cal, record = None, st.session_state.get("cot_n_cal", cot_ship.DEFAULTS["n_calibration"]), None
    with shows_errors():
        cal, n_cal, record = calibration_section(ctx, family, task, force=generate)
    # a trace's figures: the page's record (model, seed, the sidebar's prompt), naming the calibration whose
    # detector raised the alarm (the stored one's command and date, or this page's run)
    with page_provenance(ctx.provenance(calibration_run=run_summary(record))), shows_errors():
        trace_section(ctx, family, task, n_cal, cal, generate)
    with shows_errors():
        evaluation_section(ctx, family, task, n_cal, st.session_state.get("cot_bins", 10))

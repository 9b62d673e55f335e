"""Contrast: which features separate two sets of reasoning steps (reflection steps against the rest,
correct against wrong traces, two prompt sets), with effect sizes, intervals, FDR and held-out AUROC.

On the organism (`toy-reasoner`) the steps are its planted traces, whose step kinds are known; on
any other model they come from greedy traces of two sets of questions. On any model they can also come from a
RISE harvest: RISE's own traces of the model's task, cut and labelled by the family's judge (reflection,
backtracking, other) and scored by the task (`analyses.contrast.run.harvest_source`; kept in the activation
store, so a second contrast of the same harvest reads it back). The page opens on the
stored contrast of `toy-reasoner:small` (`thoughtscope ship contrast`), labelled as such.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from analyses.contrast import ContrastSettings, export_direction, save_direction
from analyses.contrast import ship as contrast_ship
from analyses.contrast.run import run_contrast
from analyses.contrast.steps import default_question_sets
from analyses.families import default_task
from analyses.feature_browser import VectorDirection
from analyses.organism import is_organism
from analyses.rise import saved_saes
from analyses.steering_stack import from_feature_browser
from app import jobs
from app.export import plain, show_figure
from app.figures.contrast import top_table
from app.registry import PageSpec
from app.sections.tasks import at_most_held, task_picker
from app.steering_stack_ui import add_button
from probes.interventions import load_vector_bytes
from thoughtscope import shipped

PAGE = PageSpec("Contrast", ":material/compare_arrows:", 35, requires=("capture_batch",))

RULES = {"reflection steps vs the rest": "kind:reflection", "backtrack steps vs the rest": "kind:backtrack",
         "redundant steps vs compute steps": "kind:redundant/compute", "correct vs wrong traces": "correct",
         "steps after vs up to the CUSUM alarm": "alarm",
         "two random halves (the null)": "random"}
# a RISE harvest's steps: the judge's kinds (analyses.rise.labels), the task's scoring, the null
HARVEST_RULES = {"reflection steps vs the rest": "kind:reflection", "backtracking steps vs the rest":
                 "kind:backtracking", "correct vs wrong traces": "correct", "two random halves (the null)": "random"}
HARVEST = "a RISE harvest (the judge's step kinds)"
# a model other than the organism: 16 seeded word problems a set, adding against taking away (two questions a set,
# the page's first default, could never be split into development and held-out traces)
SET_A, SET_B = ("\n".join(questions) for questions in default_question_sets())


def site_options(ctx) -> dict[str, str]:
    """{spec: label} of every site the page can contrast on this model."""
    arch = ctx.backend.arch()
    options = {f"direction:resid_post.{layer}": f"difference of means at resid_post.{layer}"
               for layer in range(arch.n_layers)}
    options.update({f"heads:{layer}": f"head output norms of layer {layer}" for layer in range(arch.n_layers)})
    for sae in saved_saes(ctx.model_id):
        options[f"sae:{sae.folder}@{sae.site}"] = f"SAE latents: {sae.label}"
    return options


def controls(ctx, organism: bool) -> tuple[dict[str, Any], bool]:
    options = site_options(ctx)
    n_layers = ctx.backend.arch().n_layers
    # the organism's last layer (its stored contrast's); elsewhere the middle layer, RISE's default on SmolLM2 (15 of 30)
    layer = n_layers - 1 if organism else n_layers // 2
    source = st.radio("Steps from", ["planted traces" if organism else "two question sets", HARVEST], horizontal=True,
                      key="ct_source")
    harvest_n, harvest_task = 0, None
    if source == HARVEST:  # the harvest reads the residual stream only: directions and SAEs there
        harvest_task = task_picker(st, "Task the harvest generates traces of", default_task(ctx.model_id),
                                   "ct_harvest_task")
        options = {k: v for k, v in options.items() if not k.startswith("heads:")}
        sites = st.multiselect("Sites", list(options), default=[f"direction:resid_post.{layer}"],
                               format_func=options.get, key="ct_harvest_sites")
    else:
        sites = st.multiselect("Sites", list(options), default=[f"direction:resid_post.{layer}", f"heads:{layer}"],
                               format_func=options.get, key="ct_sites")
    cols = st.columns(3)
    lines: tuple[Any, Any] = (None, None)
    if source == HARVEST:
        # the organism's greedy traces are nearly all correct, SmolLM2's arithmetic traces hold no reflection step
        first = "reflection steps vs the rest" if organism else "correct vs wrong traces"
        labels = [first, *(r for r in HARVEST_RULES if r != first)]
        rule = HARVEST_RULES[cols[0].selectbox("Sets", labels, key="ct_harvest_rule")]
        harvest_n = cols[1].slider("Problems harvested", 8, 400, 64, 8, key="ct_harvest_n",
                                   help="RISE generates a trace of each, cuts it into steps and labels them; stored, "
                                        "so the next contrast of this harvest reads it back")
        traces = 0
        harvest_n = at_most_held(st, harvest_task, harvest_n)
    elif organism:
        rule = RULES[cols[0].selectbox("Sets", list(RULES), key="ct_rule")]
        traces = cols[1].slider("Planted traces (dev split)", 8, 400, 60, 4, key="ct_traces")
    else:
        rule, traces = "source", 0
        left, right = st.columns(2)
        lines = (left.text_area("Set A questions (one a line)", SET_A, key="ct_set_a").splitlines(),
                 right.text_area("Set B questions", SET_B, key="ct_set_b").splitlines())
    resamples = cols[2].select_slider("Bootstrap resamples", [200, 500, 1000, 2000], 1000, key="ct_resamples")
    run = st.button("Contrast", type="primary", key="ct_run", icon=":material/compare_arrows:",
                    help="runs as a job: reads the steps at the sites, then ranks every feature")
    return {"sites": sites, "rule": rule, "traces": int(traces), "lines": lines, "resamples": int(resamples),
            "harvest_n": int(harvest_n), "harvest_task": harvest_task}, run


def own_result(ctx, chosen: dict[str, Any], run: bool) -> Any:
    key = ctx.result_key("contrast", **{k: v for k, v in chosen.items()})
    backend = ctx.backend

    def work(job: jobs.Job) -> Any:
        settings = ContrastSettings(n_resamples=chosen["resamples"])
        a, b = chosen["lines"]
        harvest = chosen["harvest_task"] if chosen["harvest_n"] else None
        return run_contrast(backend, chosen["sites"], chosen["rule"], settings, organism=chosen["traces"],
                            prompts_a=a, prompts_b=b, on_progress=job.progress, harvest=harvest,
                            harvest_n=chosen["harvest_n"] or 64)

    resumes = "each harvested batch of traces is kept in the activation store and read back" if chosen["harvest_n"] else ""
    return jobs.run_job(key, work, label="Contrasting two sets of steps", kind="contrast", page="contrast", start=run,
                        resumes=resumes)


def draw(data: dict[str, Any], record: dict[str, Any] | None, direction: tuple[bytes, str, str] | None,
         d_model: int | None = None) -> None:
    """The result; with `direction` its download, and with `d_model` (the loaded model's width, when the
    direction is this model's) the button that adds it to the steering stack."""
    n = data["n"]
    cols = st.columns(4)
    cols[0].metric("Set A steps (dev / held-out)", f"{n['dev_a']} / {n['heldout_a']}")
    cols[1].metric("Set B steps (dev / held-out)", f"{n['dev_b']} / {n['heldout_b']}")
    cols[2].metric("Features at q \u2264 " + str(data["settings"]["alpha"]), f"{data['n_significant']:,}")
    top = data["top"][0] if data["top"] else None
    if top:
        h = top["heldout_auroc"]
        cols[3].metric("Top feature's held-out AUROC", f"{h['estimate']:.3f}", help=f"95% [{h['low']:.3f}, "
                       f"{h['high']:.3f}] over {h['n']} held-out steps; {top['site']} #{top['feature']}")
    rule = data.get("rule", {})
    st.caption(f"A: {rule.get('A')}; B: {rule.get('B')}. Ranked by |standardised mean difference| on the development "
               f"traces ({n['dev_traces']}); held-out AUROC on the other {n['heldout_traces']} traces, never seen "
               "while ranking. Benjamini-Hochberg q over every feature; a direction is fit on half of the "
               "development traces and scored on the other half.")
    show_figure(None, data, "contrast_volcano", provenance=record)
    st.dataframe(top_table(data), hide_index=True)
    for row in data["top"]:
        if row.get("contexts"):
            with st.expander(f"Top contexts of {row['site']} latent {row['feature']}"):
                for c in row["contexts"]:
                    st.markdown(f"- **{c['activation']:.3g}** (set {c['set']}) `{c['text']}`")
    if direction is not None:
        payload, label, site = direction
        left, right = st.columns(2)
        if d_model is not None:
            with left:
                add_button("ct_add_to_stack", lambda: stack_term(payload, label, site, d_model))
        right.download_button(f"Use as direction: {label} (.safetensors, for the Steering page)", payload,
                              file_name="contrast_direction.safetensors", key="ct_export", icon=":material/download:")


def stack_term(payload: bytes, label: str, site: str, d_model: int) -> Any:
    """The exported direction as a steering-stack term at its site, checked against the loaded model's width."""
    vector = load_vector_bytes(payload)
    return from_feature_browser(VectorDirection(vector, site, f"contrast: {label}"), d_model, strength=0.5,
                                label=f"contrast: {label}")


def stored_section(ctx) -> None:
    """The shipped contrast of toy-reasoner:small (labelled as that model's, whatever model is loaded)."""
    here = ctx.model_id == contrast_ship.MODEL
    stored = shipped.find(contrast_ship.NAME, contrast_ship.MODEL, ctx.backend.info()["fingerprint"] if here else None)
    if not stored:
        (st.warning if stored.damaged else st.caption)(stored.reason)
        return
    if not here:
        st.markdown(f"**Below: the stored contrast of `{contrast_ship.MODEL}`, not of `{ctx.model_id}`.**")
    st.success(stored.label(), icon=":material/inventory_2:")
    data = stored.json("contrast.json")["result"]
    payload = stored.path("direction.safetensors").read_bytes()
    site = next(r["site"] for r in data["top"] if r["kind"] == "direction").split(":", 1)[1]  # what ship.py exported
    d_model = ctx.backend.arch().d_model
    if not here:  # another model's direction: downloadable, but it cannot steer this model (another width, or weights)
        st.caption(f"The stored direction is `{contrast_ship.MODEL}`'s: it can be downloaded, not added to "
                   f"`{ctx.model_id}`'s steering stack.")
    draw(data, stored.provenance, (payload, f"the top direction ({site})", site), d_model if here else None)


def render(ctx) -> None:
    st.title("Contrast")
    organism = is_organism(ctx.model_id)
    chosen, run = controls(ctx, organism)
    done = own_result(ctx, chosen, run)
    if done is None:
        if jobs.registry().for_key(ctx.result_key("contrast", **chosen)) is None:
            st.info("Press **Contrast** to rank every feature of these sites; below, a stored result.")
            stored_section(ctx)
        return
    result, steps, sites = done
    data = plain(result.to_dict())
    exportable = next((r for r in result.top if r["kind"] != "heads"), None)
    direction = None
    if exportable is not None:
        vector, site = export_direction(result, exportable, sites)
        direction = (save_direction(vector, site, None, meta={"rule": result.rule, "row": exportable["site"]}),
                     f"{exportable['site']} #{exportable['feature']}", site)
    st.caption(f"{steps.describe()['n_steps']:,} steps of {steps.describe()['n_traces']} traces.")
    draw(data, ctx.provenance(settings={"contrast": {k: v for k, v in chosen.items() if k != "lines"}}), direction,
         ctx.backend.arch().d_model)

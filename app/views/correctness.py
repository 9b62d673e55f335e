"""Correctness: the loaded model's validation, every site the engine reads against independent readers.

The table `thoughtscope validate` prints (probes.validate): per site kind and reader (a plain HF
forward, nnsight, the TransformerLens bridge) the worst layer's max abs and relative error and
smallest cosine, the logits against a float32 copy of the weights, and streamed records against a
teacher-forced forward; the readers skipped, with the reason. The user can run it (in this process).
"""

from __future__ import annotations

import streamlit as st

from app.badge import badge_markdown, badge_tooltip, in_process_engine
from app.context import shows_errors
from app.registry import PageSpec

PAGE = PageSpec("Correctness", ":material/verified:", 90)


def _table(rows: list[dict], columns: list[str]) -> None:
    st.dataframe([{c: row.get(c) for c in columns} for row in rows], hide_index=True, width="stretch")


def render(ctx) -> None:
    from probes.validate import TOLERANCES, cached_report, validate

    st.title("Correctness")
    st.markdown("Are the numbers in the figures the model's? Every site the engine reads is read again by "
                "independent readers on the same input; the verdict follows the tolerances of the model's dtype "
                "(docs/validation.md).")
    engine = in_process_engine(ctx.backend)
    summary = ctx.backend.info().get("validation")
    if engine is None:
        if summary is None:
            st.info("The model server has no validation of its model cached. Run `thoughtscope validate --model "
                    f"{ctx.model_id}` where the server runs; its /info then reports it here.")
        else:
            st.markdown(badge_markdown(summary), help=badge_tooltip(summary))
            st.json(summary)
        return
    run = st.button("Run validation", type="primary", icon=":material/play_arrow:", key="run_validation",
                    help="every site, three readers, logits vs float32, streamed generation (the embedded model: "
                         "tens of seconds on a CPU)")
    if run:
        with shows_errors() as spot, st.spinner("Reading every site four ways\u2026"):
            validate(engine)
        if spot.failed:
            return
    report = cached_report(engine.handle)
    if report is None:
        st.info("This model as loaded has not been validated yet: press **Run validation** (the trace explorer "
                "also starts it in the background after its first figure).")
        return
    summary = report.summary()
    st.markdown(badge_markdown(summary), help=badge_tooltip(summary))
    key = report.key
    st.caption(f"{report.model_id}, fingerprint `{key['fingerprint']}`, {key['dtype']} on {key['device']}, "
               f"{key['attn_implementation']} attention; {report.seconds:.1f} s.")
    st.subheader("Sites, per kind (the worst layer)")
    _table(report.by_kind(), ["kind", "reader", "sites", "max_abs", "max_rel", "cosine", "verdict", "worst_site",
                              "note"])
    if report.unchecked:
        st.warning("No reader could read: " + ", ".join(report.unchecked))
    st.subheader("Logits and streamed generation")
    st.json({"logits vs float32": report.logits, "streamed generation": report.generation})
    if report.skipped:
        st.subheader("Readers skipped, and why")
        _table(report.skipped, ["reader", "what", "reason"])
    with st.expander("Every site"):
        _table([c.__dict__ for c in report.checks], ["site", "reader", "max_abs", "max_rel", "cosine", "verdict",
                                                     "note"])
    with st.expander("Tolerances per dtype"):
        st.dataframe([{"dtype": name, **tol.__dict__} for name, tol in TOLERANCES.items()], hide_index=True)

"""What the RLKV page draws of a finished compressed generation (both texts with their error modes, the KV
bytes per token) and of an evaluation report (accuracy against sparsity, the runs' tables, the notes)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from app.export import show_figure
from app.figures.rlkv import accuracy_figure, generation_figure, page_tables


def draw_generation(found: dict[str, Any], provenance: dict[str, Any]) -> None:
    left, right = st.columns(2)
    left.caption(f"full cache: **{found['full_mode']}**")
    left.text(found["full_text"])
    right.caption(f"compressed: **{found['mode']}**")
    right.text(found["text"])
    show_figure(generation_figure(found), found, "rlkv_generation", provenance=provenance)


def draw_evaluation(report: dict[str, Any]) -> None:
    show_figure(accuracy_figure(report), report, "rlkv_accuracy", provenance=report.get("provenance"))
    accuracy, error_modes = page_tables(report)
    st.dataframe(accuracy, hide_index=True, key="rlkv_eval_table",
                 column_config={"McNemar p": st.column_config.NumberColumn(format="%.2g")})
    st.caption("How each run's answers went wrong (problems of the evaluation split):")
    st.dataframe(error_modes, hide_index=True, key="rlkv_error_modes")
    for line in report.get("notes", []):
        st.caption(line)

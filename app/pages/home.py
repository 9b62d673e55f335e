"""Home: what the workbench does, which model is loaded, and where to go next."""

from __future__ import annotations

import streamlit as st

from app.registry import PageSpec, discover_pages

PAGE = PageSpec("Home", ":material/home:", 0)


def page_summary(doc: str, title: str) -> str:
    """A page module's docstring as one line, without the title it usually starts with."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    for prefix in (f"{title}:", f"{title} -", title):
        if first.lower().startswith(prefix.lower()):
            return first[len(prefix):].strip()
    return first


def render(ctx) -> None:
    st.title("thoughtscope")
    st.markdown("Look inside a language model while it reasons: generate, record what happens inside it "
                "token by token, steer the next generation, and export every figure with its data.")
    info = ctx.backend.info()
    arch = info.get("arch", {})
    cols = st.columns(4)
    cols[0].metric("Model", ctx.model_id)
    cols[1].metric("Layers", arch.get("n_layers", "?"))
    cols[2].metric("Heads", arch.get("n_heads", "?"))
    cols[3].metric("Device", info.get("device", "?"))
    st.subheader("Pages")
    for spec, module in discover_pages():
        if spec.order > 0:
            st.markdown(f"- **{spec.title}**: {page_summary(module.__doc__ or '', spec.title)}")
    st.subheader("The prompt")
    st.caption("Set in the sidebar; every page uses it. This is what the model receives:")
    st.json(ctx.model_input(), expanded=False)

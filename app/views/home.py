"""Home: what the workbench does, which model is loaded, where to go next, and the documentation."""

from __future__ import annotations

import re
from pathlib import Path

import streamlit as st

from app.context import shows_errors
from app.registry import PageSpec, discover_pages

PAGE = PageSpec("Home", ":material/home:", 0)

DOCS = Path(__file__).resolve().parents[2] / "docs"
# References to design notes that live outside the repository ("(METHODS.md section 1)") say nothing to a
# reader of the app; the page's own documentation in docs/ is linked instead.
_OUTSIDE_REFERENCE = re.compile(r"\s*\((?:see )?METHODS\.md(?:\s+(?:section|method)\s+\d+)?\)"  # a parenthesis
                                 r"|[;,]\s*METHODS\.md(?:\s+(?:section|method)\s+\d+)?"  # the last item of one
                                 r"|(?:see )?METHODS\.md(?:\s+(?:section|method)\s+\d+)?[;,]\s*")  # any other item


def without_outside_references(text: str) -> str:
    """`text` without its references to design notes outside the repository.

    >>> without_outside_references("Expert-Sample (Chen et al., reconstructed; METHODS.md section 6).")
    'Expert-Sample (Chen et al., reconstructed).'
    """
    return _OUTSIDE_REFERENCE.sub("", text)


def page_summary(doc: str, title: str) -> str:
    """A page module's docstring as one line, without the title it usually starts with."""
    first = without_outside_references(" ".join(doc.strip().split("\n\n")[0].split()))
    for prefix in (f"{title}:", f"{title} -", title):
        if first.lower().startswith(prefix.lower()):
            return first[len(prefix):].strip()
    return first


def doc_for(page_name: str) -> Path | None:
    """docs/<page>.md when the repository documents that page."""
    path = DOCS / f"{page_name}.md"
    return path if path.is_file() else None


def render(ctx) -> None:
    st.title("thoughtscope")
    st.markdown("Look inside a language model while it reasons: generate, record what happens inside it "
                "token by token, steer the next generation, and export every figure with its data.")
    info = ctx.backend.info()
    arch = ctx.backend.arch()
    # The model id is text of any length: a metric would cut it ("smollm2-13..."), so it gets its own line.
    with st.container(border=True, key="home-model"):
        st.markdown(f"**Model** `{ctx.model_id}`  \nfingerprint `{info.get('fingerprint', '?')}`"
                    + (f", served by {ctx.server_url}" if ctx.server_url else ", in this process"))
        cols = st.columns(4)
        cols[0].metric("Layers", arch.n_layers)
        cols[1].metric("Heads", arch.n_heads)
        cols[2].metric("Width", arch.d_model)
        cols[3].metric("Device", info.get("device", "?"))
    st.subheader("Pages")
    for spec, module in discover_pages():
        if spec.order > 0:
            name = module.__name__.rsplit(".", 1)[-1]
            doc = doc_for(name)
            where = f" (docs: `docs/{doc.name}`)" if doc else ""
            st.markdown(f"- **{spec.title}**: {page_summary(module.__doc__ or '', spec.title)}{where}")
    st.subheader("The prompt")
    st.caption("Set in the sidebar; every page uses it. This is what the model receives:")
    with shows_errors():
        st.json(ctx.model_input(), expanded=False)
    st.subheader("Documentation")
    st.caption("The repository's docs/ folder, readable here without a network.")
    for path in sorted(DOCS.glob("*.md")):
        # A document is drawn when its expander is opened: drawn hidden in all of them (280 kB of markdown),
        # it held a new tab's Home for about a second before its first element showed (app.bench,
        # `page_first_result_s`' Home row).
        box = st.expander(f"docs/{path.name}", key=f"home-doc-{path.stem}", on_change="rerun")
        if box.open:
            # images are relative files the app does not serve: their alt text stands in
            text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"*(figure: \1)*", without_outside_references(path.read_text()))
            box.markdown(text)

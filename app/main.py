"""The Streamlit entry point: the shared sidebar, then navigation over Home and every page in app/views/.

Launch with `thoughtscope app [--model ID] [--server URL] [--port 8501]`, or directly with
`streamlit run app/main.py -- --model tiny-random:llama`. The launch options become the sidebar's
defaults through the environment variables THOUGHTSCOPE_MODEL and THOUGHTSCOPE_SERVER.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `streamlit run` puts app/ on sys.path, not the repository root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from app import first_paint, outage, warm  # noqa: E402
from app.context import PageContext  # noqa: E402
from app.export import page_provenance  # noqa: E402
from app.persist import forget, hold_widgets  # noqa: E402
from app.registry import discover_pages  # noqa: E402
from app.sidebar import MODEL_ENV, SERVER_ENV, SIDEBAR_KEYS, sidebar_context  # noqa: E402
from probes.backend import require  # noqa: E402
from streamlit.errors import StreamlitAPIException  # noqa: E402
from thoughtscope.errors import ThoughtscopeError  # noqa: E402
from thoughtscope.imports import settle  # noqa: E402


def apply_launch_args(argv: list[str]) -> None:
    """`-- --model ID --server URL` after `streamlit run app/main.py` -> the sidebar's defaults."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--server")
    args, _ = parser.parse_known_args(argv)
    if args.model:
        os.environ[MODEL_ENV] = args.model
    if args.server:
        os.environ[SERVER_ENV] = args.server


@st.cache_resource
def page_icon():
    """The tab icon, drawn here and served by the app itself: a `:material/...:` icon would make the
    browser fetch an SVG from fonts.gstatic.com, and this app works offline."""
    from PIL import Image, ImageDraw  # lazy: drawn once per session; PIL stays out of the first paint

    img = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    draw = ImageDraw.Draw(img)
    draw.ellipse((6, 6, 46, 46), outline=(0, 114, 178, 255), width=7)  # a lens...
    draw.line((40, 40, 58, 58), fill=(0, 114, 178, 255), width=9)  # ...with its handle
    for i, h in enumerate((10, 18, 13)):  # and a few bars of a read-out inside it
        draw.rectangle((16 + 7 * i, 34 - h, 20 + 7 * i, 34), fill=(230, 159, 0, 255))
    return img


class Frame:
    """What the sidebar made this run, read by the page when it runs: the navigation is drawn before the
    sidebar loads the model, so the page links stay usable while a model loads (or a toy trains)."""

    ctx: PageContext | None = None


def run_page(module, ctx: PageContext | Frame | None) -> None:
    """Render one page; a user's mistake becomes an st.error with its message, not a traceback.

    Pages catch their own errors next to the control that caused them (`app.context.shows_errors`);
    this is the last resort. While the page draws, its exports carry the page's provenance record.
    A model server that stopped answering (in the sidebar or during the page) is said first, at the top."""
    if isinstance(ctx, Frame):
        ctx = ctx.ctx
    first_paint.begin_page(module.__name__.rsplit(".", 1)[-1])  # a new visit draws its first figure first
    top = st.container()  # the lost-server banner (app/outage.py), filled once the page has drawn
    try:
        _render_page(module, ctx)
    except Exception:  # a bug's traceback still shows, under the banner (not Streamlit's rerun and stop signals)
        outage.show_banner(top)
        raise
    first_paint.end_page()  # a first run that drew no figure opens the gate: later runs are never cut short
    outage.show_banner(top)


def _render_page(module, ctx: PageContext | None) -> None:
    if ctx is None:
        if outage.current() is None:
            st.warning("No model is loaded: pick another model or backend in the sidebar (the error is shown there).")
        return
    try:
        require(ctx.backend, *module.PAGE.requires)
    except ThoughtscopeError as err:
        outage.note_error(err)
        st.info(f"{module.PAGE.title} is not available here: {err}")
        return
    name = module.__name__.rsplit(".", 1)[-1]
    try:
        with page_provenance(ctx.provenance(page=name)):
            module.render(ctx)
    except ThoughtscopeError as err:
        outage.note_error(err)
        st.error(str(err))


def main(only: str | None = None) -> None:
    """Draw the app; `only` restricts the navigation to one page module (used by the tests)."""
    st.set_page_config(page_title="thoughtscope", page_icon=page_icon(), layout="wide")
    served = bool(sys.argv) and Path(sys.argv[0]).resolve() == Path(__file__).resolve()  # by `streamlit run`
    if served:
        apply_launch_args(sys.argv[1:])
        first_paint.enable()  # served by `streamlit run`: a browser reports each visit's first figure painted
        first_paint.load_preview_renderer()  # a new tab: the preview's element loads while the page draws
    # Every widget keeps the user's value on every navigation path (app/persist.py says why it would not).
    restored = hold_widgets(skip=SIDEBAR_KEYS)
    frame = Frame()
    pages = []
    for spec, module in discover_pages():
        name = module.__name__.rsplit(".", 1)[-1]
        if only is not None and name != only:
            continue
        pages.append(st.Page(partial(run_page, module, frame), title=spec.title, icon=spec.icon, url_path=name,
                             default=not pages))
    if not pages:
        st.error(f"no page named {only!r} in app/views/")
        return
    page = st.navigation(pages)  # the links first: usable while the sidebar below loads a model
    settle("pandas")  # an import of it under way in another session's run: this page's figures wait for it whole
    frame.ctx = sidebar_context()
    try:
        page.run()
        if served:  # a browser's session: the libraries later pages load lazily, imported once per process now
            warm.start()
    except StreamlitAPIException:
        if not restored:
            raise
        # A page refused a value it was given back (its range has shrunk since, e.g. a shorter trace):
        # that page starts from its defaults instead of failing.
        forget(restored)
        st.rerun()


if __name__ == "__main__":
    main()

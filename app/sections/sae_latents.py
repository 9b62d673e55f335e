"""Page parts for SAE latents (issue 25): which SAEs this model has, the latents of a trace and of each
token (the trace explorer), and the text search over latent labels (the feature browser).

Drawing only: the latents come from `analyses.feature_browser.token_latents`, the labels and the
search from `analyses.feature_browser.labels` / `.search`.
"""

from __future__ import annotations

import json
from typing import Any

import streamlit as st

from analyses.contrast.core import save_direction
from analyses.feature_browser.directions import SAELatent
from analyses.feature_browser.labels import labels_for, labels_path
from analyses.feature_browser.search import LabelSearch
from analyses.feature_browser.token_latents import TraceLatents, trace_latents
from analyses.rise import saved_saes
from analyses.rise import ship as rise_ship
from analyses.steering_stack import from_feature_browser
from app import jobs
from app.context import shows_errors
from app.steering_stack_ui import add_button
from saes.io import load_sae
from thoughtscope import shipped


def sae_choices(ctx, site: str | None = None) -> dict[str, tuple[str, str]]:
    """{folder: (label, site)} of the SAEs of this model: saved by RISE runs, and the shipped RISE SAE."""
    out = {s.folder: (s.label, s.site) for s in saved_saes(ctx.model_id, site)}
    found = shipped.find(rise_ship.NAME, ctx.model_id, ctx.backend.info().get("fingerprint"))
    if found:
        for at in rise_ship.shipped_sites(found):
            if site is None or at == site:
                cfg = found.json(f"sae.{at}.cfg.json")
                out[str(rise_ship.sae_folder(found, at))] = (f"{ctx.model_id} {at} d_sae={cfg.get('d_sae')} "
                                                             "(the RISE page's stored SAE)", at)
    return out


@st.cache_resource(show_spinner=False, max_entries=4)
def cached_sae(folder: str) -> Any:
    return load_sae(folder)


def feature_link(site: str, latent: int) -> str:
    return f"/feature_browser?site={site}&latent={latent}"


def _latent_rows(rows: list[dict[str, Any]], site: str, value: str) -> list[dict[str, Any]]:
    return [{"latent": r["latent"], value: round(r[value], 4), "open": feature_link(site, r["latent"]),
             **({"peaks at": repr(r["peak_token"])} if "peak_token" in r else {})} for r in rows]


@st.cache_resource(show_spinner=False, max_entries=8)
def _trace_latents(_ctx, _done, key: str, folder: str, site: str) -> TraceLatents:
    rows = _done.trace.activations.get(site)
    return trace_latents(_ctx.backend, list(_done.trace.token_ids), cached_sae(folder), site, rows=rows)


def trace_latents_section(ctx, key: str, done: Any) -> None:
    """The top latents of the whole trace, and the latents active at a chosen token, for a chosen SAE."""
    st.subheader("SAE latents")
    choices = sae_choices(ctx)
    if not choices:
        # a caption, not an info box: nothing is refused, there is simply no SAE of this model yet
        st.caption(f"No SAE of `{ctx.model_id}` yet: train one on the RISE page (it is kept for this page and the "
                   "feature browser).")
        return
    folder = st.selectbox("SAE", list(choices), format_func=lambda f: choices[f][0], key="te_sae")
    site = choices[folder][1]
    with shows_errors() as spot:
        found = _trace_latents(ctx, done, key, folder, site)
    if spot.failed:
        return
    config = {"open": st.column_config.LinkColumn("feature browser", display_text="open")}
    left, right = st.columns(2)
    with left:
        st.caption(f"Top latents of the whole trace at {site} (highest activation; the first token left out)")
        st.dataframe(_latent_rows(found.top_of_trace(k=15), site, "score"), column_config=config, hide_index=True,
                     key="te_top_latents")
    with right:
        n = len(found.tokens)
        position = st.selectbox("Token", range(n), index=n - 1, key=f"te_token_{n}",
                                format_func=lambda p: f"{p}: {found.tokens[p]!r}")
        active = found.at_token(int(position), k=20)
        st.caption(f"{len(active)} latents active at token {position} (of {int((found.acts[position] > 0).sum())})")
        st.dataframe(_latent_rows(active, site, "activation"), column_config=config, hide_index=True,
                     key="te_token_latents")
    if active:
        sae = cached_sae(folder)
        pick = st.selectbox("Latent to steer with", [r["latent"] for r in active], key="te_export_latent")
        payload = save_direction(sae.W_dec[int(pick)].detach().float().cpu(), site, None,
                                 meta={"sae": folder, "latent": int(pick)})
        left, right = st.columns(2)
        with left:
            add_button("te_add_to_stack", lambda: from_feature_browser(SAELatent(sae, int(pick), site, folder),
                                                                       ctx.backend.arch().d_model, strength=0.5))
        right.download_button(f"Latent {pick}'s decoder row (.safetensors)", payload,
                              file_name=f"latent_{pick}.safetensors", key="te_export", icon=":material/download:")


@st.cache_resource(show_spinner=False, max_entries=4)
def _search_index(_labels: Any, key: str) -> LabelSearch:
    return LabelSearch(_labels)


def search_section(ctx, index: Any, index_key: str, folder: str, sae: Any, site: str) -> int | None:
    """A search box over the labels of `sae`'s latents; returns the latent the user opens (or None).

    Labelling every latent is a job the first time (its decoder words read the unembedding once per
    latent: about 2 minutes for 16k latents of SmolLM2 here); after that the labels load from beside the SAE."""
    query = st.text_input("Search latents by text (tokens they fire on, words they write, their contexts)",
                          key="fb_query", max_chars=500)
    if not query.strip():
        return None
    key = json.dumps(["latent-labels", folder, index_key])
    backend = ctx.backend
    run = False
    if jobs.registry().finished(key) is None and jobs.registry().for_key(key) is None and \
            not labels_path(folder).is_file():
        run = st.button("Label every latent (once per SAE and corpus)", key="fb_label", icon=":material/label:")
    labels = jobs.run_job(key, lambda job: labels_for(folder, sae, index, backend, on_progress=job.progress),
                          label="Labelling every latent", kind="latent-labels", page="feature_browser",
                          start=run or labels_path(folder).is_file())
    if labels is None:
        return None
    with shows_errors() as spot:
        hits = _search_index(labels, key).search(query, k=10)
    if spot.failed:
        return None
    if not hits:
        st.info(f"No latent's label mentions {query!r}.")
        return None
    shown = {h.latent: f"{h.latent} ({h.score:.2f}): {h.summary}" for h in hits}
    return st.radio("Matches (best first)", list(shown), format_func=shown.get, key="fb_hit")

"""Steering: add a direction at one layer with a scale slider; the steered text beside the unsteered one."""

from __future__ import annotations

import hashlib

import numpy as np
import streamlit as st

from analyses.steering import (GeneratedText, diff_of_means_direction, generate_text, sae_feature_direction,
                               steered_comparison)
from app.export import show_figure
from app.figures.trace import steering_figure
from app.registry import PageSpec
from probes.interventions import RESIDUAL_KINDS, load_vector_bytes

PAGE = PageSpec("Steering", ":material/tune:", 20)

FROM_PROMPTS = "two prompt sets (difference of means)"
FROM_FILE = "a .safetensors vector"
FROM_SAE = "a saved SAE feature"
SET_A = "I love this, it is wonderful.\nWhat a happy, joyful day!\nThis is great news, I am so glad."
SET_B = "I hate this, it is terrible.\nWhat a sad, miserable day.\nThis is awful news, I am so upset."


@st.cache_data(show_spinner=False, max_entries=32)
def prompt_direction(_ctx, model_key: str, set_a: str, set_b: str, site: str, reduce: str) -> np.ndarray:
    return diff_of_means_direction(_ctx.backend, set_a.splitlines(), set_b.splitlines(), site, reduce).numpy()


@st.cache_data(show_spinner=False, max_entries=32)
def unsteered(_ctx, key: str) -> GeneratedText:
    s = _ctx.settings
    return generate_text(_ctx.backend, _ctx.model_input(), max_new_tokens=s.max_new_tokens, sampling=s.sampling(),
                         seed=_ctx.seed, chat=_ctx.chat)


@st.cache_data(show_spinner=False, max_entries=128)
def comparison(_ctx, key: str, site: str, direction_key: str, scale: float, _direction: np.ndarray):
    s = _ctx.settings
    return steered_comparison(_ctx.backend, _ctx.model_input(), site, _direction, scale,
                              max_new_tokens=s.max_new_tokens, sampling=s.sampling(), seed=_ctx.seed,
                              chat=_ctx.chat, unsteered=unsteered(_ctx, key))


@st.cache_data(show_spinner=False, max_entries=32)
def sae_direction(folder: str, feature: int, d_model: int, site: str) -> np.ndarray:
    return sae_feature_direction(folder, feature, d_model, site).numpy()


def pick_direction(ctx, site: str) -> np.ndarray | None:
    source = st.radio("Direction from", [FROM_PROMPTS, FROM_FILE, FROM_SAE], horizontal=True, key="steer_source")
    if source == FROM_SAE:
        left, right = st.columns([3, 1])
        folder = left.text_input("SAE folder (SAELens format: cfg.json + sae_weights.safetensors)", key="steer_sae")
        feature = right.number_input("Feature", 0, 10**7, 0, key="steer_feature")
        if not folder.strip():
            st.info("Give the folder of an SAE trained on this model's activations at the chosen site.")
            return None
        d_model = ctx.backend.info()["arch"]["d_model"]
        return sae_direction(folder.strip(), int(feature), d_model, site)
    if source == FROM_PROMPTS:
        left, right = st.columns(2)
        set_a = left.text_area("Set A: steer towards (one prompt a line)", SET_A, key="steer_set_a")
        set_b = right.text_area("Set B: steer away from", SET_B, key="steer_set_b")
        reduce = st.radio("Per prompt, take", ["mean", "last"], horizontal=True, key="steer_reduce",
                          help="the mean over all positions, or the last position only")
        with st.spinner("Tracing both prompt sets\u2026"):
            return prompt_direction(ctx, f"{ctx.server_url}|{ctx.model_id}", set_a, set_b, site, reduce)
    upload = st.file_uploader("Steering vector", type=["safetensors"], key="steer_upload",
                              help="one tensor of width d_model, saved with safetensors.torch.save_file")
    name = st.text_input("Tensor name (only if the file holds several)", key="steer_tensor").strip() or None
    if upload is None:
        st.info("Upload a .safetensors file holding the vector.")
        return None
    return load_vector_bytes(upload.getvalue(), name).numpy()


def render(ctx) -> None:
    st.title("Steering")
    n_layers = ctx.backend.info()["arch"]["n_layers"]
    left, right = st.columns(2)
    kind = left.selectbox("Site", RESIDUAL_KINDS, index=RESIDUAL_KINDS.index("resid_post"), key="steer_kind")
    layer = right.selectbox("Layer", range(n_layers), index=n_layers // 2, key="steer_layer")
    site = f"{kind}.{layer}"
    direction = pick_direction(ctx, site)
    if direction is None:
        return
    st.caption(f"direction at `{site}`: |v| = {float(np.linalg.norm(direction)):.3g}")
    scale = st.slider("Scale", -12.0, 12.0, 4.0, 0.5, key="steer_scale", help="adds scale * v at every position")
    direction_key = hashlib.sha256(direction.tobytes()).hexdigest()[:16]
    with st.spinner("Generating with and without the direction (same seed)\u2026"):
        result = comparison(ctx, ctx.cache_key(), site, direction_key, float(scale), direction)
    left, right = st.columns(2)
    with left.container(border=True, key="unsteered-text"):
        st.markdown("**Unsteered**")
        st.text(result.unsteered_text)
    with right.container(border=True, key="steered-text"):
        st.markdown(f"**Steered** (scale {result.scale:g})")
        st.text(result.steered_text)
    show_figure(steering_figure(result), result, "steering")

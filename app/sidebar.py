"""The shared sidebar: backend and model, prompt (chat or raw), generation settings, seed -> `PageContext`.

The in-process model is loaded once per process (`st.cache_resource`); picking another model
clears that entry first, so two models never sit in memory together. A server backend
(`probes.client.RemoteBackend`) is imported only when the user picks a server URL.
"""

from __future__ import annotations

import gc
import os
import threading

import streamlit as st

from app.context import FinishedGenerations, GenerationSettings, PageContext
from thoughtscope.errors import ThoughtscopeError
from probes.zoo import DEFAULT_MODEL, TINY_ARCHS, TOY_MODELS, local_hf_models

MODEL_ENV = "THOUGHTSCOPE_MODEL"  # set by `thoughtscope app --model` (or by hand)
SERVER_ENV = "THOUGHTSCOPE_SERVER"  # set by `thoughtscope app --server`
TOKEN_ENV = "THOUGHTSCOPE_TOKEN"  # the bearer token of a server started with --token
CUSTOM = "other id\u2026"
EXAMPLE_QUESTION = "Anna has 17 shells. She wins 3 more. How many shells does Anna have now?"

_load_lock = threading.Lock()
_loaded_model: list[str] = []  # the id whose engine `_engine` holds (module state lives as long as the process)


@st.cache_resource(max_entries=1, show_spinner="Loading the model (once per process)\u2026")
def _engine(model_id: str):
    from probes.engine import Engine

    return Engine.from_id(model_id)


def in_process_backend(model_id: str):
    """The engine for `model_id`, loading it on first use and freeing any other model first."""
    with _load_lock:
        if _loaded_model and _loaded_model[0] != model_id:
            _engine.clear()
            gc.collect()
            _free_gpu_cache()
        _loaded_model[:] = [model_id]
        return _engine(model_id)


def _free_gpu_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@st.cache_resource(show_spinner="Connecting to the model server\u2026")
def remote_backend(url: str, token: str | None = None):
    try:
        from probes.client import RemoteBackend
    except ImportError as err:
        raise ThoughtscopeError(f"the model-server client (probes.client) is not available here: {err}") from err
    return RemoteBackend(url, token=token)


@st.cache_resource
def finished_generations() -> FinishedGenerations:
    return FinishedGenerations()


@st.cache_data(ttl=300, show_spinner=False)
def model_choices() -> list[str]:
    return [DEFAULT_MODEL, *TOY_MODELS, *[f"hf:{r}" for r in local_hf_models()],
            *[f"tiny-random:{a}" for a in TINY_ARCHS]]


def _pick_model() -> str:
    choices = model_choices()
    wanted = os.environ.get(MODEL_ENV, DEFAULT_MODEL)
    options = choices if wanted in choices else [wanted, *choices]
    picked = st.selectbox("Model", [*options, CUSTOM], index=options.index(wanted), key="model_pick",
                          help="zoo models (toy-* models are trained here on first use, minutes, then cached), "
                               "hf: models in the local Hugging Face cache; tiny-random ids are for tests")
    if picked == CUSTOM:
        picked = st.text_input("Model id", placeholder="hf:<repo id or folder> or ndif:<repo id>",
                               key="model_custom").strip()
    return picked


SETTING_DEFAULTS = {"max_new_tokens": 48, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "alternatives": 5, "seed": 0}


def _settings() -> tuple[GenerationSettings, int]:
    # Defaults go through session state, so a test (or a link) may preset any of them.
    for key, value in SETTING_DEFAULTS.items():
        st.session_state.setdefault(key, value)
    with st.expander("Generation settings", expanded=False):
        max_new = st.slider("Max new tokens", 1, 256, key="max_new_tokens")
        temperature = st.slider("Temperature (0 = greedy)", 0.0, 2.0, step=0.05, key="temperature")
        top_p = st.slider("Top-p", 0.05, 1.0, step=0.05, key="top_p", disabled=temperature == 0)
        top_k = st.number_input("Top-k (0 = off)", 0, 1000, key="top_k", disabled=temperature == 0)
        alternatives = st.slider("Alternatives kept per token", 1, 10, key="alternatives")
        seed = st.number_input("Seed", 0, 2**31 - 1, key="seed")
    settings = GenerationSettings(int(max_new), float(temperature), float(top_p), int(top_k), int(alternatives))
    return settings, int(seed)


def sidebar_context() -> PageContext | None:
    """Draw the sidebar and return the context every page renders with (None if no model could load)."""
    with st.sidebar:
        st.header("thoughtscope")
        default_server = os.environ.get(SERVER_ENV, "")
        where = st.radio("Backend", ["in-process", "server"], index=1 if default_server else 0, horizontal=True,
                         key="backend_kind", help="in-process: the model runs in this app; server: `thoughtscope serve`")
        server_url = None
        if where == "server":
            server_url = st.text_input("Server URL", value=default_server or "http://127.0.0.1:8765",
                                       key="server_url").strip()
            token = st.text_input("Token (if the server has one)", value=os.environ.get(TOKEN_ENV, ""),
                                  type="password", key="server_token").strip() or None
        else:
            model_id = _pick_model()
        chat = st.toggle("Chat template", value=True, key="chat",
                         help="wrap the prompt in the model's chat template; off: raw text continuation")
        one_shot = st.checkbox("With a worked example (one-shot)", value=True, key="one_shot", disabled=not chat)
        prompt = st.text_area("Prompt", value=EXAMPLE_QUESTION, height=110, key="prompt")
        settings, seed = _settings()
        try:
            if server_url is not None:
                backend = remote_backend(server_url, token)
                model_id = backend.info().get("model_id", "?")
            else:
                backend = in_process_backend(model_id)
        except ThoughtscopeError as err:
            st.error(str(err))
            return None
        except Exception as err:  # a server that does not answer: the client's own transport errors
            if server_url is None:
                raise
            st.error(f"could not reach the model server at {server_url}: {err}")
            return None
        st.caption(f"model: `{model_id}`" + (f" at {server_url}" if server_url else " (in-process)"))
    return PageContext(backend=backend, model_id=model_id, prompt=prompt, chat=chat, settings=settings, seed=seed,
                       server_url=server_url, one_shot=one_shot)

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
import torch

from app import outage
from app.context import (CONFIRM_LABEL, FinishedGenerations, GenerationSettings, PageContext, prompt_warn_default)
from app.persist import keep, kept, mirror_to_url, seed_from_url
from app.switch import apply_backend_request, apply_request
from probes.engine import Engine
from probes.zoo import DEFAULT_MODEL, TINY_ARCHS, local_hf_models, needs_training, prepare_model, toy_model_ids
from thoughtscope import checks
from thoughtscope.errors import ThoughtscopeError

MODEL_ENV = "THOUGHTSCOPE_MODEL"  # set by `thoughtscope app --model` (or by hand)
SERVER_ENV = "THOUGHTSCOPE_SERVER"  # set by `thoughtscope app --server`
TOKEN_ENV = "THOUGHTSCOPE_TOKEN"  # the bearer token of a server started with --token
CUSTOM = "other id\u2026"
EXAMPLE_QUESTION = "Anna has 17 shells. She wins 3 more. How many shells does Anna have now?"

_load_lock = threading.Lock()
_loaded_model: list[str] = []  # the id whose engine `_engine` holds (module state lives as long as the process)


@st.cache_resource(max_entries=1, show_spinner="Loading the model (once per process)\u2026")
def _engine(model_id: str):
    return Engine.from_id(model_id)


def in_process_backend(model_id: str):
    """The engine for `model_id`, loading it on first use and freeing any other model first."""
    with _load_lock:
        if _loaded_model and _loaded_model[0] != model_id:
            _engine.clear()
            gc.collect()
            _free_gpu_cache()
        _loaded_model[:] = [model_id]
        _train_with_progress(model_id)
        return _engine(model_id)


def _train_with_progress(model_id: str) -> None:
    """A toy model neither shipped nor cached trains here, outside the cached `_engine`, with a bar."""
    if not needs_training(model_id):
        return
    bar = st.progress(0.0, text=f"Training {model_id} once (then cached)\u2026")
    prepare_model(model_id, on_progress=lambda done, total, what: bar.progress(
        min(done / max(total, 1), 1.0), text=f"{what}: step {done} of {total}"))
    bar.empty()


def _free_gpu_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@st.cache_resource(show_spinner="Connecting to the model server\u2026")
def remote_backend(url: str, token: str | None = None):
    try:
        from probes.client import RemoteBackend
    except ImportError as err:
        raise ThoughtscopeError(f"the model-server client (probes.client) is not available here: {err}") from err
    from thoughtscope import checks

    # a URL httpx cannot even parse (a NUL, a bad port, an address past 255) is said, not an InvalidURL traceback
    return RemoteBackend(checks.server_url(url, "the server URL"), token=token)


@st.cache_resource
def finished_generations() -> FinishedGenerations:
    return FinishedGenerations()


@st.cache_data(ttl=300, show_spinner=False)
def model_choices() -> list[str]:
    return [DEFAULT_MODEL, *toy_model_ids(), *[f"hf:{r}" for r in local_hf_models()],
            *[f"tiny-random:{a}" for a in TINY_ARCHS]]


def _pick_model() -> str:
    requested = apply_request()  # a "Switch to" button's model, written into the box's state
    choices = model_choices()
    wanted = os.environ.get(MODEL_ENV, DEFAULT_MODEL)
    options = choices if wanted in choices else [wanted, *choices]
    held = kept("model_pick", wanted)
    options = options if held in options or held == CUSTOM else [held, *options]
    choice = [*options, CUSTOM]
    # A requested model is the box's state already; an index beside it made Streamlit log "created with a
    # default value but also had its value set via the Session State API" (the state, not the index, wins).
    picked = st.selectbox("Model", choice, index=None if requested else choice.index(held), key="model_pick",
                          help="zoo models (toy-* models are trained here on first use, minutes, then cached), "
                               "hf: models in the local Hugging Face cache; tiny-random ids are for tests")
    keep("model_pick", picked)
    if picked == CUSTOM:
        picked = keep("model_custom", st.text_input("Model id", kept("model_custom", ""), key="model_custom",
                                                    placeholder="hf:<repo id or folder> or ndif:<repo id>")).strip()
    return picked


SETTING_DEFAULTS = {"max_new_tokens": 48, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "alternatives": 5, "seed": 0}
# Each setting's widget range, in one place: the widgets below, and the values a URL may bring (a value outside,
# from a hand-edited or an old link, was handed to the widget and stopped the page with a traceback)
SETTING_RANGES = {"max_new_tokens": (1, 256), "temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "top_k": (0, 1000),
                  "alternatives": (1, 10), "seed": (0, checks.SEED_MAX)}
# The sidebar's widgets: they take their held value through `value=` (app/persist.py).
SIDEBAR_KEYS = ("backend_kind", "server_url", "server_token", "model_pick", "model_custom", "chat", "one_shot", "prompt",
                *SETTING_DEFAULTS, "prompt_warn_tokens")


# The sidebar's settings that a reload or a copied link carries in the URL (the token never does).
URL_SETTINGS = {**SETTING_DEFAULTS, "chat": True, "one_shot": True, "prompt": EXAMPLE_QUESTION}
URL_PROMPT_MAX = 2000  # characters: a longer prompt holds within the session, not in the URL


def _held(key: str) -> object:
    return kept(key, URL_SETTINGS[key])


def _settings() -> tuple[GenerationSettings, int]:
    # Each widget's value is the one the user gave it (app/persist.py): a test may still preset any of
    # them through session state, which Streamlit puts before `value=`.
    with st.expander("Generation settings", expanded=False):
        r = SETTING_RANGES
        max_new = keep("max_new_tokens", st.slider("Max new tokens", *r["max_new_tokens"], _held("max_new_tokens"),
                                                   key="max_new_tokens"))
        temperature = keep("temperature", st.slider("Temperature (0 = greedy)", *r["temperature"],
                                                    float(_held("temperature")), step=0.05, key="temperature"))
        top_p = keep("top_p", st.slider("Top-p", *r["top_p"], float(_held("top_p")), step=0.05, key="top_p",
                                        disabled=temperature == 0))
        top_k = keep("top_k", st.number_input("Top-k (0 = off)", *r["top_k"], int(_held("top_k")), key="top_k",
                                              disabled=temperature == 0))
        alternatives = keep("alternatives", st.slider("Alternatives kept per token", *r["alternatives"],
                                                      _held("alternatives"), key="alternatives"))
        seed = keep("seed", st.number_input("Seed", *r["seed"], int(_held("seed")), key="seed"))
        keep("prompt_warn_tokens", st.number_input(
            "Warn above (prompt tokens)", 1, 10**7, int(kept("prompt_warn_tokens", prompt_warn_default())), step=500,
            key="prompt_warn_tokens",
            help="a longer prompt (or one whose generation would pass the model's context) asks for a confirmation "
                 "first; default from THOUGHTSCOPE_PROMPT_WARN_TOKENS"))
    settings = GenerationSettings(int(max_new), float(temperature), float(top_p), int(top_k), int(alternatives))
    return settings, int(seed)


def sidebar_context() -> PageContext | None:
    """Draw the sidebar and return the context every page renders with (None if no model could load)."""
    seed_from_url({key: type(value) for key, value in URL_SETTINGS.items()}, SETTING_RANGES)
    with st.sidebar:
        st.header("thoughtscope")
        default_server = os.environ.get(SERVER_ENV, "")
        kinds = ["in-process", "server"]
        moved = apply_backend_request()  # a "Switch to" button's model runs in this app: the radio's state is set
        where = keep("backend_kind", st.radio(
            "Backend", kinds, index=None if moved else kinds.index(kept("backend_kind", kinds[1 if default_server else 0])),
            horizontal=True, key="backend_kind", help="in-process: the model runs in this app; server: `thoughtscope serve`"))
        server_url = None
        if where == "server":
            server_url = keep("server_url", st.text_input(
                "Server URL", value=kept("server_url", default_server or "http://127.0.0.1:8765"), key="server_url")).strip()
            token = keep("server_token", st.text_input(
                "Token (if the server has one)", value=kept("server_token", os.environ.get(TOKEN_ENV, "")),
                type="password", key="server_token")).strip() or None
        else:
            model_id = _pick_model()
        chat = keep("chat", st.toggle("Chat template", value=bool(_held("chat")), key="chat",
                                      help="wrap the prompt in the model's chat template; off: raw text continuation"))
        one_shot = keep("one_shot", st.checkbox("With a worked example (one-shot)", value=bool(_held("one_shot")),
                                                key="one_shot", disabled=not chat))
        prompt = keep("prompt", st.text_area("Prompt", value=str(_held("prompt")), height=110, key="prompt",
                                             help="at most 200,000 characters (probes.tokens.MAX_PROMPT_CHARS)"))
        prompt_box = st.container()  # a long prompt's warning and confirmation, once the backend is known
        settings, seed = _settings()
        mirror_to_url({key: (value if key != "prompt" or len(prompt) <= URL_PROMPT_MAX else prompt)
                       for key, value in URL_SETTINGS.items()})
        outage.clear()
        try:
            if server_url is not None:
                backend = remote_backend(server_url, token)
                info = backend.info()
                model_id = info.get("model_id", "?")
                outage.remember(server_url, backend, info)
            else:
                backend = in_process_backend(model_id)
        except Exception as err:  # ThoughtscopeError, or a server's answer the client could not read
            if server_url is None and not isinstance(err, ThoughtscopeError):
                raise
            st.error(str(err) if isinstance(err, ThoughtscopeError) else
                     f"could not reach the model server at {server_url}: {err}")
            if server_url is None:
                return None
            # the top of the page says so (app/outage.py); the page still draws what it holds
            outage.note(server_url, err)
            backend = _last_known(server_url, token)
            if backend is None:
                return None
            model_id = backend.info().get("model_id", "?")
        st.caption(f"model: `{model_id}`" + (f" at {server_url}" if server_url else " (in-process)")
                   + (" (not answering: its last known state)" if outage.current() else ""))
    ctx = PageContext(backend=backend, model_id=model_id, prompt=prompt, chat=chat, settings=settings, seed=seed,
                      server_url=server_url, one_shot=one_shot,
                      prompt_warn_tokens=int(kept("prompt_warn_tokens", prompt_warn_default())))
    _confirm_long_prompt(prompt_box, ctx)
    return ctx


def _last_known(server_url: str, token: str | None):
    try:
        return outage.last_known(server_url, remote_backend(server_url, token))
    except ThoughtscopeError:
        return None


def _confirm_long_prompt(box, ctx: PageContext) -> None:
    """A long prompt's estimate and the checkbox that lets every page run it (app/context.py's guard).

    The tick holds for this prompt only: another prompt (or model) starts unconfirmed."""
    try:
        estimate = ctx.prompt_estimate()
    except ThoughtscopeError as err:  # empty, over the character cap, over the context: the pages say it too
        if ctx.prompt.strip():  # a warning: a page that does not use the sidebar's prompt still works
            box.warning(f"{err} (pages that use this prompt will refuse it)", icon=":material/warning:")
        return
    if estimate is None:
        return
    asked = f"{ctx.model_id}|{len(ctx.prompt)}|{hash(ctx.prompt)}|{estimate.n_tokens}"
    if st.session_state.get("_ts_long_prompt_for") != asked:
        st.session_state["_ts_long_prompt_for"] = asked
        st.session_state["long_prompt_ok"] = False  # before the checkbox is drawn: a new prompt is unconfirmed
    box.warning(estimate.message(), icon=":material/hourglass_top:")
    ctx.long_prompt_confirmed = bool(box.checkbox(CONFIRM_LABEL, key="long_prompt_ok"))

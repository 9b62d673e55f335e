"""RLKV head maps (Du et al. 2025): which KV heads a model needs for reasoning, and what a cache that keeps
only those heads in full costs and saves.

The map (`analyses.rlkv.head_map.HeadMap`, what `thoughtscope rlkv map` prints) is learned (a gates file
from `thoughtscope rlkv train`, or gates trained on this page) or read from attention statistics for any
model without training. A sparsity slider binarises it (the top 1 - s heads keep the full cache, the
others sink + recent entries) and shows the KV memory; a generation under that compressed cache is
tagged with its error mode; an evaluation (a JSON file from `thoughtscope eval rlkv`, or a small one run
here) gives accuracy against sparsity for RLKV and its baselines; the gates' training log gives the
training curves. Training (GRPO, checkpointed and resumed), the attention statistics, the compressed
generation and the evaluation run as jobs (`app.jobs.run_job`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st

from analyses.rlkv.evaluate import compressed_generation, evaluate_rlkv
from analyses.rlkv.head_map import HeadMap
from analyses.rlkv.probe import can_train
from analyses.rlkv.train import SHIPPED_RUN, train_gates, training_folder
from analyses.rlkv.data import task_problems
from app.context import drawing_report, read_report, shows_errors
from app.export import show_figure
from app.figures.rlkv import head_map_figure, memory_figure, training_figure
from app.jobs import one_step, run_job
from app.registry import PageSpec
from app.sections.tasks import at_most_held, task_picker
from app.sections.rlkv import draw_evaluation, draw_generation

PAGE = PageSpec("RLKV head maps", ":material/memory:", 60, requires=("generate", "kv_policy"))

LEARNED = "learned gates (a gates file)"
ATTENTION = "attention statistics (no training)"
TRAINED = "gates trained on this page"
PAGE_NAME = "rlkv"
# The project's own measured run (docs/rlkv.md), offered as the default for the model it was trained on,
# so the page opens on a real head map and evaluation instead of empty inputs.
_DOCS = Path(__file__).resolve().parents[2] / "docs"
SHIPPED = {"smollm2-135m": (_DOCS / "rlkv_run", _DOCS / "rlkv_results_n120.json")}


def shipped(model_id: str, which: int) -> str:
    """The shipped gates folder (0) or evaluation JSON (1) for `model_id`, or "" when there is none."""
    paths = SHIPPED.get(model_id)
    return str(paths[which]) if paths and paths[which].exists() else ""


def head_map_section(ctx, task: str) -> HeadMap | None:
    st.subheader("1. Head map")
    trained = st.session_state.get("rlkv_trained")
    source = st.radio("Map from", [LEARNED, ATTENTION, *([TRAINED] if trained else [])], horizontal=True,
                      key="rlkv_source", help="gates trained on this page appear once a training job has finished")
    c1, c2 = st.columns(2)
    sink = int(c1.number_input("Sink tokens (local heads)", 0, 512, 4, key="rlkv_sink"))
    recent = int(c2.number_input("Recent tokens (local heads)", 1, 4096, 32, key="rlkv_recent"))
    if source in (LEARNED, TRAINED):
        path = trained if source == TRAINED else st.text_input(
            "Gates file or folder (`thoughtscope rlkv train --out DIR`; for SmolLM2 the run measured in docs/rlkv.md "
            "is filled in)", value=shipped(ctx.model_id, 0), key="rlkv_gates_path").strip()
        if not path:
            st.info("Give the folder of a training run, or switch to attention statistics.")
            return None
        with shows_errors():
            return HeadMap.from_gates(path, ctx.backend, sink, recent)
        return None
    if not ctx.backend.capabilities().get("attention"):
        st.warning("This backend cannot capture attention patterns; load a gates file instead.")
        return None
    left, right = st.columns([3, 1])
    n = at_most_held(left, task, left.slider("Traces (task problems, greedy, full cache)", 1, 32, 4,
                                             key="rlkv_attn_n"), "the map")
    right.write("")
    run = right.button("Compute", key="rlkv_attn_run", icon=":material/play_arrow:")
    backend, seed, max_new = ctx.backend, ctx.seed, ctx.settings.max_new_tokens
    key = ctx.result_key("rlkv-attention", n=n, sink=sink, recent=recent, seed=seed, tokens=max_new, task=task)
    found = run_job(key, lambda job: HeadMap.from_attention(backend, task_problems(task, n, seed=seed), sink, recent,
                                                            max_new_tokens=max_new, progress=job.progress,
                                                            task=task),
                    label=f"Reading attention on {n} traces", kind="rlkv-attention", page=PAGE_NAME, start=run)
    if found is None:
        st.info("Press **Compute** for each KV head's attention mass outside its sink + recent window.")
    return found


def sparsity_section(ctx, head_map: HeadMap) -> float:
    st.subheader("2. Sparsity")
    s = st.slider("Sparsity: fraction of KV heads made local", 0.0, 0.95, 0.5, 0.05, key="rlkv_sparsity")
    full = head_map.full_heads(s)
    length = max(256, ctx.settings.max_new_tokens + 128)
    cols = st.columns(3)
    cols[0].metric("Heads with the full cache", f"{int(full.sum())} of {full.size}")
    cols[1].metric(f"KV memory at {length} tokens", f"{head_map.kv_fraction(s, length):.0%}")
    cols[2].metric("KV memory at 4096 tokens", f"{head_map.kv_fraction(s, 4096):.0%}")
    data, record = head_map.to_dict(s), map_record(ctx, head_map, s)  # one record (one /info call) for both
    show_figure(head_map_figure(data), data, "rlkv_head_map", provenance=record)
    mem = head_map.memory(s, max_length=4096)
    show_figure(memory_figure(mem), mem, "rlkv_memory", provenance=record)
    return s


def map_record(ctx, head_map: HeadMap, sparsity: float | None = None) -> dict[str, Any]:
    """The provenance of a figure drawn from the head map: where its scores came from (the gates file and the
    training run that wrote it, or the attention statistics' traces), the window and the sparsity."""
    source = {k: v for k, v in head_map.to_dict().items() if k in ("kind", "gates_file", "trained_on", "n", "task")}
    if head_map.training is not None:
        source["training"] = head_map.training
    settings: dict[str, Any] = {"head_map": source, "sink": head_map.sink, "recent": head_map.recent}
    if sparsity is not None:
        settings["sparsity"] = sparsity
    return ctx.provenance(settings=settings, data=head_map.data_name(), prompt=None)


def generation_section(ctx, head_map: HeadMap, sparsity: float) -> None:
    st.subheader("3. A generation under compression")
    answer = st.text_input("Known answer (optional: tells correct from wrong)", key="rlkv_answer").strip() or None
    run = st.button("Generate", type="primary", key="rlkv_generate", icon=":material/play_arrow:")
    policy = head_map.policy(sparsity)
    key = ctx.cache_key(kind="rlkv-generation", full=policy.full_heads, sink=policy.sink, recent=policy.recent,
                        answer=answer)
    backend, model_input, chat, s, seed = ctx.backend, ctx.model_input(), ctx.chat, ctx.settings, ctx.seed
    work = one_step("full cache, then the compressed one", lambda: compressed_generation(
        backend, model_input, policy, chat=chat, answer=answer, max_new_tokens=s.max_new_tokens,
        sampling=s.sampling(), seed=seed))
    found = run_job(key, work, label="Generating with the full cache and the compressed one",
                    kind="rlkv-generation", page=PAGE_NAME, start=run)
    if found is not None:
        draw_generation(found, ctx.provenance(interventions=[policy], settings={"sparsity": sparsity}))


def training_section(ctx, head_map: HeadMap | None) -> None:
    """Learn the gates here with GRPO (`HeadGateProbe.fit`, what `thoughtscope rlkv train` runs) as a job,
    checkpointed in the user cache so a stopped run resumes where it stopped."""
    st.subheader("Train the gates (GRPO)")
    d = SHIPPED_RUN
    c1, c2, c3, c4 = st.columns(4)
    steps = int(c1.number_input("Steps", 1, 500, d["steps"], key="rlkv_train_steps"))
    prompts = int(c2.number_input("Prompts per step", 1, 64, d["prompts_per_step"], key="rlkv_train_prompts"))
    group = int(c3.number_input("Samples per prompt (G)", 2, 16, d["group_size"], key="rlkv_train_group"))
    n_train = int(c4.number_input("Training problems", 1, 1000, d["n_train"], key="rlkv_train_n"))
    c1, c2, c3, c4 = st.columns(4)
    max_new = int(c1.number_input("Max new tokens", 4, 256, d["max_new_tokens"], key="rlkv_train_tokens"))
    temperature = float(c2.number_input("Temperature", 0.05, 2.0, d["temperature"], 0.05, key="rlkv_train_t"))
    ops = c3.selectbox("Operators", ["+", "+-", "+-*"], key="rlkv_train_ops", help="one-step arithmetic problems")
    sink, recent = (head_map.sink, head_map.recent) if head_map else (4, 32)
    settings = {"task": d["task"], "ops": ops, "n_train": n_train, "seed": ctx.seed, "steps": steps,
                "prompts_per_step": prompts, "group_size": group, "max_new_tokens": max_new,
                "temperature": temperature, "sink": sink, "recent": recent}
    if shipped(ctx.model_id, 0) and settings == {**d, "sink": 4, "recent": 32}:
        st.caption(f"These are the settings of the shipped run ({shipped(ctx.model_id, 0)}, docs/rlkv.md): its head "
                   "map and training curves are shown above. Training again takes about 80 s a step on two CPU cores.")
    # a model server cannot train the gates: the button says so before a click rather than failing with the
    # command line's advice
    trainable = can_train(ctx.backend)
    start = c4.button("Train", key="rlkv_train_run", icon=":material/play_arrow:", disabled=not trainable)
    if not trainable:
        st.caption("Training the gates runs in the process that holds the model: pick **in-process** under "
                   "Backend in the sidebar, or run `thoughtscope rlkv train --model ...` on the server's machine.")
    backend, folder = ctx.backend, training_folder(ctx.backend.info()["fingerprint"], settings)
    with shows_errors():
        done = run_job(ctx.result_key("rlkv-train", **settings),
                       lambda job: str(train_gates(backend, settings, folder, on_progress=job.progress)),
                       label=f"Training RLKV gates ({steps} GRPO steps)", kind="rlkv-train", page=PAGE_NAME,
                       start=start, resumes="the gates, the optimiser and the log are checkpointed after every GRPO "
                                            "step")
        if done is not None and st.session_state.get("rlkv_trained") != done:
            st.session_state["rlkv_trained"] = done  # the head map offers it as a source from now on
            st.rerun()
        if done is not None:
            st.caption(f"Trained gates in `{done}`: pick \"{TRAINED}\" in the head map above.")


def evaluation_section(ctx, head_map: HeadMap | None, task: str) -> None:
    st.subheader("4. Accuracy against sparsity")
    path = st.text_input("An evaluation JSON (`thoughtscope eval rlkv --json > eval.json`)",
                         value=shipped(ctx.model_id, 1), key="rlkv_eval_path").strip()
    report = None
    with shows_errors():
        report = read_report(path, "an RLKV evaluation report", {"curves": dict, "rows": list},
                             "thoughtscope eval rlkv --json > eval.json") if path else None
    c1, c2, c3 = st.columns(3)
    n = c1.slider("Or run one here: evaluation problems", 2, 100, 4, key="rlkv_eval_n")
    levels = sorted(c2.multiselect("Sparsities", [0.2, 0.4, 0.5, 0.6, 0.8], default=[0.5], key="rlkv_eval_levels"))
    c3.write("")
    run = c3.button("Run evaluation", key="rlkv_eval_run", icon=":material/play_arrow:")
    gates = head_map.gates_file if head_map else None
    key = ctx.result_key("rlkv-eval", n=n, levels=levels, gates=gates, tokens=ctx.settings.max_new_tokens, task=task)
    backend, max_new = ctx.backend, ctx.settings.max_new_tokens
    sink, recent = (head_map.sink, head_map.recent) if head_map else (4, 32)

    def work(job):
        return evaluate_rlkv(backend, task, levels, gates=gates, n=n, n_dev=2, n_calibration=2, random_seeds=1,
                             snapkv_windows=[4], max_new_tokens=max_new, sink=sink, recent=recent,
                             progress=job.progress).to_dict()

    found = run_job(key, work, label=f"RLKV evaluation on {n} problems", kind="rlkv-eval", page=PAGE_NAME,
                    start=bool(run and levels))
    if report is not None and found is None and report.get("task") not in (None, task):
        st.caption(f"The evaluation file was run on **{report['task']}**, not on the task chosen above; press **Run "
                   "evaluation** for that task.")
    if report is not None:  # the file named above is drawn first (as before), its inner fields checked as it draws
        with shows_errors(), drawing_report(path, "an RLKV evaluation report"):
            draw_evaluation(report)
    elif found is not None:
        draw_evaluation(found)


def render(ctx) -> None:
    st.title("RLKV head maps")
    st.caption("Du et al. 2025: gates learned with RL mix each KV head's full and local attention; heads whose gates "
               "stay high are the reasoning heads that keep the full cache, the others keep a sink + recent window.")
    task = task_picker(st, "Task (problems for the attention statistics and the evaluation; training draws its own "
                           "one-step arithmetic)", "arith", "rlkv_task")
    head_map = head_map_section(ctx, task)
    if head_map is not None:
        sparsity = sparsity_section(ctx, head_map)
        generation_section(ctx, head_map, sparsity)
        if head_map.log:
            st.subheader("Training curves")
            show_figure(training_figure({"log": head_map.log}), {"log": head_map.log}, "rlkv_training",
                        provenance=map_record(ctx, head_map))
    training_section(ctx, head_map)
    evaluation_section(ctx, head_map, task)

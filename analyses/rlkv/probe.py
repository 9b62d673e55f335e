"""RLKV's gate probe: which KV heads a model needs for reasoning, learned with reinforcement learning.

Du et al. 2025, "Which Heads Matter for Reasoning? RL-Guided KV Cache Compression" (RLKV, arXiv
2510.08525). The model is frozen and every KV head gets a gate alpha in [0, 1] that mixes its full
attention with a sink + recent local one (`probes.gates`). The gates are trained with GRPO on a task
with a verifiable reward (`analyses.grpo`), plus an adaptive L1 penalty that only pushes gates down
while the gated model still solves its problems. Heads whose gates stay high are the reasoning heads:
at inference they keep the full KV cache and the others keep sink + recent entries (`policy`).

`HeadGateProbe` is a scikit-learn style estimator: the constructor stores its arguments, `fit`
sets `gates_` (numpy [layers, kv_heads]) and `log_` (one row per step: mean reward, mean gate,
sparsity, penalty weight, loss, ...). With a `checkpoint_dir`, the gates, the optimiser state and the
log are saved after every `checkpoint_every` steps (safetensors + JSON) and a later `fit` with the
same settings resumes there. Each step's rollouts are seeded by (seed, step), so a resumed run draws
what the uninterrupted run would have drawn.

Paper defaults are the parameters' defaults where they transfer: AdamW lr 1e-2, beta 1e-3, tau 0.5,
G = 4. The paper's windows (sink 128 + recent 256 in training, 16 + 64 at evaluation) are for traces
of thousands of tokens; `sink`/`recent` here default to 16 + 64, and the embedded model's ~150-token
prompts and traces need smaller ones (docs/rlkv.md says what the reported run used). [recon] Sequences
of a group whose rewards are all equal have zero advantage and are skipped (no gradient is lost);
the L1 term uses the mean gate over all heads.

Example (a tiny random model: a few seconds):
    >>> from probes import Engine
    >>> from analyses.tasks import load_task
    >>> probe = HeadGateProbe(sink=1, recent=4, steps=2, prompts_per_step=2, max_new_tokens=4, lr=0.05)
    >>> probe = probe.fit(Engine.from_id("tiny-random:llama"), load_task("arith", 4))
    >>> probe.gates_.shape, len(probe.log_), int(probe.keep_full(0.5).sum())
    ((2, 2), 2, 2)
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from analyses.families import family_for, task_prompt
from analyses.rlkv.grpo import adaptive_l1_weight, group_advantages, policy_loss
from analyses.rlkv.heads import full_heads_from_scores
from analyses.tasks import is_correct
from probes.backend import Backend, require
from probes.engine import Sampling
from probes.gates import check_gates
from probes.kv_policy import HeadBudget
from thoughtscope import checks
from thoughtscope.errors import BadInputError

GATES_FILE = "gates.safetensors"
LOG_FILE = "log.json"
FORMAT = "thoughtscope-rlkv-gates/1"
RESUMABLE = ("steps", "micro_batch")  # settings a resumed run may change


def default_prompt_fn(backend: Backend) -> Callable[[Any], tuple[Any, bool]]:
    """problem -> (prompt, chat) in the model family's prompt style (`analyses.families`)."""
    family = family_for(backend)
    return lambda problem: task_prompt(problem, family)


def default_reward(text: str, problem: Any) -> float:
    """1.0 when the completion's answer matches the problem's (`analyses.tasks.is_correct`), else 0.0."""
    return 1.0 if is_correct(text, problem) else 0.0


def can_train(backend: Backend) -> bool:
    """Whether gates can be trained on `backend`: only in the process that holds the model (capability
    "head_gates"; the gates sit inside its attention), never through a model server."""
    return bool(backend.capabilities().get("head_gates", False))


@dataclass
class HeadGateProbe:
    """Gates learned with GRPO without KL plus the adaptive L1 penalty (see the module docstring)."""

    sink: int = 16
    recent: int = 64
    beta: float = 1e-3
    tau: float = 0.5
    group_size: int = 4
    lr: float = 1e-2
    weight_decay: float = 0.0
    steps: int = 30
    prompts_per_step: int = 8
    max_new_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 1.0
    skip_zero_advantage: bool = True
    micro_batch: int = 8
    init: float = 1.0
    seed: int = 0
    checkpoint_every: int = 1
    prompt_fn: Callable[[Any], tuple[Any, bool]] | None = field(default=None, repr=False)
    reward_fn: Callable[[str, Any], float] | None = field(default=None, repr=False)

    # ----- settings -----

    def settings(self) -> dict[str, Any]:
        """The hyper-parameters as plain values (what a checkpoint must agree with to be resumed)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("prompt_fn", "reward_fn",
                                                                                      "checkpoint_every")}

    def _check(self, problems: Sequence[Any]) -> None:
        for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch", "checkpoint_every"):
            checks.integer(name, getattr(self, name), low=1)
        checks.integer("group_size", self.group_size, low=2)
        for name, low, high in (("lr", 0, 10), ("beta", 0, 10), ("tau", 0, 1), ("temperature", 0, 10),
                                ("top_p", 0, 1), ("init", 0, 1), ("weight_decay", 0, 10)):
            checks.number(name, getattr(self, name), low=low, high=high)
        if self.temperature == 0:
            raise BadInputError("GRPO needs sampled completions: temperature must be > 0")
        if self.lr == 0:  # the gates would never move from their initial value
            raise BadInputError("lr must be above 0: with lr 0 the gates never move from init")
        if not problems:
            raise BadInputError("the probe needs at least one training problem")

    # ----- training -----

    def fit(self, backend: Backend, problems: Sequence[Any], on_step: Callable[[int, int, dict], None] | None = None,
            checkpoint_dir: str | Path | None = None, task: str | None = None) -> "HeadGateProbe":
        """Train the gates on `problems` (each with an `answer`; of `task`, named in the saved log when given);
        `on_step(done, total, row)` after each step.

        Runs in the process that holds the model (capability "head_gates"); a model server is refused.
        With `checkpoint_dir`, resumes a run of the same settings found there and saves as it goes.
        """
        self._check(problems)
        if not can_train(backend):
            raise BadInputError("RLKV gate training runs in the process that holds the model (the issue's design); "
                                "pass --model, not --server, to `thoughtscope rlkv train`")
        require(backend, "generate", "grad")
        info = backend.info()
        arch = backend.arch()
        shape = (arch.n_layers, arch.n_kv_heads)
        prompt_fn = self.prompt_fn or default_prompt_fn(backend)
        reward_fn = self.reward_fn or default_reward
        problems = list(problems)
        encoded = []
        for p in problems:  # every prompt check before any model work
            prompt, chat = prompt_fn(p)
            encoded.append(backend.encode(prompt, chat=chat))
        meta = {"format": FORMAT, "model": info["model_id"], "fingerprint": info["fingerprint"], "shape": list(shape),
                "settings": self.settings(),
                "problems": [{"id": getattr(p, "id", str(i)), "question": getattr(p, "question", "")}
                             for i, p in enumerate(problems)]}
        if task is not None:
            meta["task"] = task
        start, gates, opt_state, log = 0, None, None, []
        if checkpoint_dir is not None:
            found = load_checkpoint(checkpoint_dir, expect=meta)
            if found is not None:
                gates, opt_state, log = found["gates"], found["optimizer"], found["log"]
                start = len(log)
        order = list(range(len(problems)))
        random.Random(self.seed).shuffle(order)
        with backend.head_gates(sink=self.sink, recent=self.recent, init=self.init, gates=gates) as session:
            opt = torch.optim.AdamW([session.alpha], lr=self.lr, weight_decay=self.weight_decay)
            if opt_state is not None:  # this torch's own param_groups, the saved moments
                opt.load_state_dict({**opt.state_dict(), "state": opt_state["state"]})
            for step in range(start, self.steps):
                t0 = time.perf_counter()
                chosen = [order[(step * self.prompts_per_step + i) % len(order)] for i in range(self.prompts_per_step)]
                row = self._step(session, opt, [encoded[i] for i in chosen], [problems[i] for i in chosen],
                                 reward_fn, Sampling(self.temperature, self.top_p), step)
                row.update(step=step + 1, seconds=round(time.perf_counter() - t0, 3),
                           problems=[getattr(problems[i], "id", str(i)) for i in chosen])
                log.append(row)
                self.gates_ = session.alpha.detach().cpu().numpy().copy()
                if checkpoint_dir is not None and ((step + 1) % self.checkpoint_every == 0 or step + 1 == self.steps):
                    save_checkpoint(checkpoint_dir, self.gates_, opt.state_dict(), log, meta)
                if on_step is not None:
                    on_step(step + 1, self.steps, row)
            self.gates_ = session.alpha.detach().cpu().numpy().copy()
            self.pressure_ = _pressure(opt.state_dict())
        self.log_ = log
        self.model_ = {"model": info["model_id"], "fingerprint": info["fingerprint"]}
        return self

    def _step(self, session: Any, opt: torch.optim.Optimizer, prompts: list[list[int]], problems: list[Any],
              reward_fn: Callable, sampling: Any, step: int) -> dict[str, Any]:
        """One GRPO step: sample G completions per prompt, score, one gradient step on the gates."""
        n_prompts, group = len(prompts), self.group_size
        stream = session.generate(prompts=prompts, n_samples=group, max_new_tokens=self.max_new_tokens,
                                  sampling=sampling, seed=_step_seed(self.seed, step), top_k=0)
        tokens: list[list[int]] = [[] for _ in range(n_prompts * group)]
        texts = [""] * (n_prompts * group)
        for rec in stream:
            tokens[rec.batch_index].append(rec.token_id)
            texts[rec.batch_index] += rec.text
        rewards = torch.tensor([float(reward_fn(texts[i], problems[i // group])) for i in range(len(texts))])
        advantages = group_advantages(rewards.view(n_prompts, group)).flatten()
        mean_reward = float(rewards.mean())
        l1 = adaptive_l1_weight(mean_reward, self.beta, self.tau)
        used = [i for i in range(len(texts)) if not (self.skip_zero_advantage and abs(float(advantages[i])) < 1e-8)]
        opt.zero_grad()
        total = len(texts)
        policy = 0.0
        for lo in range(0, len(used), self.micro_batch):
            chunk = used[lo:lo + self.micro_batch]
            seqs = [prompts[i // group] + tokens[i] for i in chunk]
            lps = session.logprobs(seqs, [len(prompts[i // group]) for i in chunk])
            loss = policy_loss(lps, [float(advantages[i]) for i in chunk], total)
            loss.backward()
            policy += float(loss.detach())
        penalty = l1 * session.alpha.mean()
        penalty.backward()
        opt.step()
        session.clamp_()
        alpha = session.alpha.detach()
        return {"reward": mean_reward, "mean_alpha": float(alpha.mean()), "sparsity": float((alpha < 0.5).float().mean()),
                "min_alpha": float(alpha.min()), "l1_weight": l1, "policy_loss": policy, "loss": policy + float(penalty.detach()),
                "sequences": len(used), "groups_with_signal": int((advantages.view(n_prompts, group).abs() > 1e-8)
                                                                   .any(dim=1).sum()),
                "mean_tokens": float(np.mean([len(t) for t in tokens]))}

    # ----- using the gates -----

    def _fitted(self) -> np.ndarray:
        if not hasattr(self, "gates_"):
            raise BadInputError("the probe has no gates yet: fit it, or load a gates file (HeadGateProbe.load)")
        return self.gates_

    def keep_full(self, sparsity: float) -> np.ndarray:
        """bool [layers, kv_heads]: the top (1 - sparsity) fraction of heads by gate keep the full cache;
        gates clamped at 1 are ordered by `pressure_`, how hard the last steps still pushed them up."""
        return full_heads_from_scores(self._fitted(), sparsity, getattr(self, "pressure_", None))

    def policy(self, sparsity: float, sink: int = 16, recent: int = 64) -> Any:
        """The KV-cache policy of RLKV inference at `sparsity` (evaluation windows: the paper's 16 + 64)."""
        return HeadBudget(full_heads=torch.as_tensor(self.keep_full(sparsity)), sink=sink, recent=recent)

    def save(self, directory: str | Path) -> Path:
        """Write the gates (and the log, if any) to `directory`; returns the gates file."""
        meta = {"format": FORMAT, **getattr(self, "model_", {}), "shape": list(self._fitted().shape),
                "settings": self.settings(), "problems": []}
        return save_checkpoint(directory, self._fitted(), None, getattr(self, "log_", []), meta)

    @classmethod
    def load(cls, path: str | Path, backend: Backend | None = None) -> "HeadGateProbe":
        """A fitted probe from a gates file (or its folder). With `backend`, the gates must fit its model."""
        found = read_gates(path, backend)
        probe = cls(**{k: v for k, v in found["meta"].get("settings", {}).items() if k in cls.__dataclass_fields__})
        probe.gates_ = found["gates"]
        probe.pressure_ = found["pressure"]
        probe.log_ = found["log"]
        probe.model_ = {"model": found["meta"].get("model"), "fingerprint": found["meta"].get("fingerprint")}
        return probe


def _pressure(optimizer_state: dict | None) -> np.ndarray | None:
    """-(Adam's running mean gradient): how hard the loss still pushes each gate up (ties at the clamp)."""
    state = (optimizer_state or {}).get("state", {}).get(0)
    if not state or "exp_avg" not in state:
        return None
    return (-state["exp_avg"].detach().float()).cpu().numpy()


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**63 - 1)


# ----- gates files: safetensors (gates, optimiser state) + a JSON log -----


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_checkpoint(directory: str | Path, gates: np.ndarray, optimizer: dict | None, log: list[dict],
                    meta: dict[str, Any]) -> Path:
    """gates.safetensors (gates + AdamW state) and log.json (settings, problems, per-step rows), written atomically."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"gates": torch.as_tensor(gates, dtype=torch.float32).contiguous()}
    if optimizer is not None and optimizer.get("state"):
        state = optimizer["state"][0]
        tensors.update({f"adam.{k}": torch.as_tensor(v, dtype=torch.float32).reshape(-1).contiguous()
                        if k == "step" else v.detach().float().contiguous() for k, v in state.items()})
    gates_path = folder / GATES_FILE
    small = {"format": FORMAT, "model": str(meta.get("model")), "fingerprint": str(meta.get("fingerprint")),
             "steps": str(len(log))}
    _atomic_write(gates_path, lambda tmp: save_file(tensors, tmp, metadata=small))
    text = json.dumps({**meta, "log": log}, indent=1)
    _atomic_write(folder / LOG_FILE, lambda tmp: Path(tmp).write_text(text))
    return gates_path


def read_gates(path: str | Path, backend: Backend | None = None) -> dict[str, Any]:
    """{gates (numpy [layers, kv_heads]), meta, log} of a gates file or folder; with `backend`, checked against
    its model's shape before any model work (a file for another model is refused)."""
    p = checks.user_path("gates file or folder", path)
    gates_path = p / GATES_FILE if p.is_dir() else p
    if not gates_path.is_file():
        raise BadInputError(f"no gates file at {gates_path}; train one with `thoughtscope rlkv train --out DIR`")
    try:
        tensors = load_file(str(gates_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise BadInputError(f"{gates_path} is not a readable safetensors gates file: {err}") from err
    if "gates" not in tensors:
        raise BadInputError(f"{gates_path} holds no 'gates' tensor")
    log_path = gates_path.parent / LOG_FILE
    meta: dict[str, Any] = {}
    if log_path.is_file():
        try:
            meta = json.loads(log_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise BadInputError(f"{log_path} is not valid JSON: {err}") from err
        kinds = {"settings": dict, "log": list}
        if not isinstance(meta, dict) or any(not isinstance(meta.get(k, kind()), kind) for k, kind in kinds.items()):
            raise BadInputError(f"{log_path} is not a gates log: an object with settings (an object) and log (a "
                                "list) is expected")
    gates = tensors["gates"]
    if backend is not None:
        arch = backend.arch()
        shape = (arch.n_layers, arch.n_kv_heads)
        origin = f" (learned on {meta['model']})" if meta.get("model") else ""
        if tuple(gates.shape) != shape:
            raise BadInputError(f"the gates in {gates_path} have shape {tuple(gates.shape)}{origin}; "
                                f"{backend.info()['model_id']} needs {shape} (layers x KV heads)")
    gates = check_gates(gates, tuple(gates.shape), what=f"the gates in {gates_path}")
    optimizer = None
    if "adam.exp_avg" in tensors:
        optimizer = {"state": {0: {"step": tensors["adam.step"].view(()),
                                   "exp_avg": tensors["adam.exp_avg"], "exp_avg_sq": tensors["adam.exp_avg_sq"]}}}
    return {"gates": gates.numpy(), "meta": {k: v for k, v in meta.items() if k != "log"},
            "log": meta.get("log", []), "optimizer": optimizer, "pressure": _pressure(optimizer),
            "path": str(gates_path)}


def load_checkpoint(directory: str | Path, expect: dict[str, Any]) -> dict[str, Any] | None:
    """A resumable checkpoint in `directory` made with the settings in `expect`, else None (nothing there).
    A checkpoint made with other settings, or for another model, is refused rather than overwritten."""
    folder = Path(directory)
    if not (folder / GATES_FILE).is_file():
        return None
    found = read_gates(folder)
    meta = found["meta"]
    def same(key: str, a: Any, b: Any) -> bool:
        if key == "settings":  # more steps extend a run; micro-batching only changes memory
            a, b = ({k: v for k, v in (x or {}).items() if k not in RESUMABLE} for x in (a, b))
        return a == json.loads(json.dumps(b))

    for key, what in (("fingerprint", "model weights"), ("settings", "probe settings"), ("problems", "problems")):
        if not same(key, meta.get(key), expect[key]):
            raise BadInputError(f"{folder} holds a gate checkpoint made with other {what}; resume with the same "
                                "settings, or choose another --out folder")
    if found["optimizer"] is None and found["log"]:
        raise BadInputError(f"{folder} holds gates without their optimiser state; it cannot be resumed")
    return found


__all__ = ["HeadGateProbe", "default_prompt_fn", "default_reward", "read_gates", "save_checkpoint"]

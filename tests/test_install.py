"""Interventions install themselves (issue 22 item 2): a new kind needs no engine change.

The test registers a toy kind here, in the test, and uses it in generate, trace and through the
model server (an app in this process, so it knows the kind), against hand computations. It also
reads the engine and the hook runner and fails on an isinstance/type() check naming an
intervention class: the engine reads what a kind needs from the kind itself.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from probes import AddVector, BadInputError  # noqa: E402
from probes.interventions import Intervention, ProjectionRescale  # noqa: E402
from probes.registered import KINDS, Registered  # noqa: E402
from probes.routing import ExpertSample  # noqa: E402

SITE = "resid_post.0"
PROMPT = "one two three four"
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class AddConstant(Intervention):
    """Toy kind: add the number `c` to every coordinate; report its position and what it changed."""

    kind: ClassVar[str] = "test_add_constant"
    c: float = 1.0

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c

    def apply(self, view: torch.Tensor, ctx: Any) -> torch.Tensor:
        ctx.fire("toy.position", ctx.positions)  # the token position of every edited column
        return super().apply(view, ctx)

    def report(self, before: torch.Tensor, after: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"toy.added": (after - before).amax(-1)}

    def describe(self) -> str:
        return f"add the constant {self.c:g} at {self.site}"


@dataclass
class GenerationOnly(AddConstant):
    """Toy kind with declared constraints: generation only, at most one per call."""

    kind: ClassVar[str] = "test_generation_only"
    modes: ClassVar[tuple[str, ...]] = ("generate",)
    elsewhere: ClassVar[str] = "the toy applies to generate() only"
    exclusive: ClassVar[str] = "toy"
    exclusive_hint: ClassVar[str] = "one toy per call"


def test_a_new_kind_in_generate_equals_the_hand_computation(llama):
    ids = llama.encode(PROMPT)
    plain = list(llama.generate(ids, max_new_tokens=3, capture=[SITE]))
    toy = list(llama.generate(ids, max_new_tokens=3, capture=[SITE], interventions=[AddConstant(SITE, 0.5)]))
    # the first record reads the prompt's last position: the same input, so exactly the plain value plus c
    x = plain[0].activations[SITE]
    assert torch.equal(toy[0].activations[SITE], x + 0.5)
    assert toy[0].fired["toy.added"] == float(((x + 0.5) - x).max())
    # the record of token t was chosen at position len(prompt) - 1 + t
    assert [r.fired["toy.position"] for r in toy] == [len(ids) - 1 + t for t in range(3)]
    assert toy[0].interventions == ["add the constant 0.5 at resid_post.0"]
    # the same edit spelt as an AddVector of c * ones: the same tokens and log-probs
    same = list(llama.generate(ids, max_new_tokens=3, interventions=[AddVector(SITE, torch.full((64,), 0.5))]))
    assert [(r.token_id, r.logprob) for r in same] == [(r.token_id, r.logprob) for r in toy]


def test_a_new_kind_in_trace_and_its_declared_constraints(llama):
    x = llama.trace(PROMPT, capture=[SITE]).activations[SITE]
    tr = llama.trace(PROMPT, capture=[SITE], interventions=[AddConstant(SITE, -2.0)])
    assert torch.equal(tr.activations[SITE], x - 2.0)
    assert torch.equal(tr.fired["toy.added"], ((x - 2.0) - x).amax(-1))
    assert tr.fired["toy.position"].tolist() == list(range(len(x)))
    # constraints the kind declares, read by the engine without knowing the kind
    with pytest.raises(BadInputError, match="the toy applies to generate"):
        llama.trace(PROMPT, interventions=[GenerationOnly(SITE)])
    with pytest.raises(BadInputError, match="one toy per call"):
        llama.generate(PROMPT, max_new_tokens=1, interventions=[GenerationOnly(SITE), GenerationOnly(SITE)])
    with pytest.raises(BadInputError, match="resid_post.L"):
        llama.trace(PROMPT, interventions=[AddConstant("z.0")])


def test_a_new_kind_through_the_model_server(llama):
    from probes.client import RemoteBackend
    from probes.server import create_app
    from probes.server_bench import serving_in_thread

    ids = llama.encode(PROMPT)
    local = list(llama.generate(ids, max_new_tokens=3, interventions=[AddConstant(SITE, 0.5)]))
    local_trace = llama.trace(PROMPT, interventions=[AddConstant(SITE, 0.5)])
    with serving_in_thread(create_app(llama)) as url, RemoteBackend(url, timeout=60) as remote:
        served = list(remote.generate(ids, max_new_tokens=3, interventions=[AddConstant(SITE, 0.5)]))
        served_trace = remote.trace(PROMPT, interventions=[AddConstant(SITE, 0.5)])
    assert [(r.token_id, r.logprob, r.fired, r.interventions) for r in served] == \
        [(r.token_id, r.logprob, r.fired, r.interventions) for r in local]
    assert torch.equal(served_trace.logprobs[1:], local_trace.logprobs[1:])
    assert sorted(served_trace.fired) == ["toy.added", "toy.position"]
    assert torch.equal(served_trace.fired["toy.position"], local_trace.fired["toy.position"])


def test_parameters_stay_as_given_and_router_rules_keep_no_memo(llama, moe):
    scale, direction = torch.tensor([0.5, -1.0]), torch.full((64,), 2.0)
    steer, rescale = AddVector(SITE, torch.ones(64), scale), ProjectionRescale(SITE, direction, alpha=0.5)
    list(llama.generate(PROMPT, n_samples=2, max_new_tokens=2, interventions=[steer, rescale]))
    assert steer.scale is scale and rescale.direction is direction and torch.equal(direction, torch.full((64,), 2.0))
    bound = rescale.validate(llama.handle.arch)  # the derived values are on the per-call copy
    assert bound is not rescale and torch.allclose(bound.direction_, torch.full((64,), 0.125))
    assert "direction_" not in rescale.__dict__
    rule = ExpertSample(k_h=1, m=4, seed=3)
    before = dict(rule.__dict__)
    list(moe.generate("hello", max_new_tokens=2, interventions=[rule]))
    assert rule.__dict__ == before  # no memo of a router spec or of positions on the rule


def _intervention_class_names() -> set[str]:
    import probes.kv_policy  # noqa: F401  (every kind registered)
    import probes.routing  # noqa: F401

    names = {"Registered", "CompressedCache"}
    for cls in KINDS.values():
        names.update(c.__name__ for c in cls.__mro__ if issubclass(c, Registered))
    return names


@pytest.mark.parametrize("path", ["probes/engine.py", "probes/hooks.py"])
def test_the_engine_has_no_switch_over_intervention_kinds(path):
    names = _intervention_class_names()
    assert {"AddVector", "MaskAttention", "RowMask", "KVPolicy", "RouterRule", "Intervention"} <= names
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "isinstance", "issubclass", "type"):
            mentioned = {n.id for a in node.args for n in ast.walk(a) if isinstance(n, ast.Name)}
            mentioned |= {n.attr for a in node.args for n in ast.walk(a) if isinstance(n, ast.Attribute)}
            found += sorted(mentioned & names)
        if isinstance(node, ast.Constant) and node.value in names:  # a type-name string compare
            found.append(node.value)
    assert found == []

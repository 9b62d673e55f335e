"""ndif: models through nnsight traces, rehearsed with nnsight's remote="local" (the request is serialised as
NDIF would receive it, deserialised and run with this project unimportable: probes.ndif.StrictRehearsal).

Every served method of an `ndif:`-style backend equals the in-process engine on the same weights. The
tolerance is exact (0) throughout: the trace runs the same modules in the same order on the same inputs,
and the edits are the same `apply()` calls. (No network here: a real NDIF run is not part of the tests.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probes import Engine, Sampling
from probes.edits import Additive
from probes.attention_masks import RowMask
from probes.interventions import AddVector, HeadAblation, MaskAttention, ProjectionRescale
from probes.kv_policies import SinkRecent
from probes.ndif import rehearse
from thoughtscope.errors import BadInputError, ModelLoadError
from probes.server import create_app
from probes.server_bench import serving_in_thread

SITES = ["resid_post.0", "z.1", "mlp_out.1"]


@pytest.fixture(scope="module")
def ndif_llama(llama):
    """The rehearsal backend over the session's tiny llama weights (shared, no second load)."""
    return Engine(rehearse(llama.handle))


def _vector(seed: int = 0) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(seed))


EDITS = {
    "add": AddVector("resid_post.0", _vector(), scale=2.0),
    "rescale": ProjectionRescale("resid_pre.1", _vector(1), alpha=1.0),
    "ablate": HeadAblation(1, [0, 2]),
    "steer": Additive("resid_post.0", _vector(2), strength=2.0, term="up", tokens="prompt", start=1),
}
# row 0: no mask; row 1: key 1 hidden from query 3 in every layer; row 2: keys 0 and 2 hidden in layer 1 only
MASKS = [RowMask([1], queries=[3], rows=[1]), RowMask([0, 2], rows=[2], layers=[1])]
TEXT = "one two three four"


def _assert_traces_equal(theirs, ours):
    for site in SITES:
        torch.testing.assert_close(theirs.activations[site], ours.activations[site], atol=0, rtol=0)
    torch.testing.assert_close(theirs.logprobs, ours.logprobs, atol=0, rtol=0, equal_nan=True)
    assert theirs.fired.keys() == ours.fired.keys()
    for name in ours.fired:
        torch.testing.assert_close(theirs.fired[name], ours.fired[name], atol=0, rtol=0, equal_nan=True)


def test_trace_plain_and_with_every_site_edit_and_row_masks_equals_the_engine(llama, ndif_llama):
    """Two rehearsal traces (each one serialised request): the plain one, and one with every site edit at
    once plus row masks (three rows of the same text). Each edit and each mask acts: the engine's trace
    without it differs."""
    _assert_traces_equal(ndif_llama.trace(TEXT, capture=SITES), llama.trace(TEXT, capture=SITES))
    every = [*EDITS.values(), *MASKS]
    ours, theirs = llama.trace(TEXT, capture=SITES, interventions=every), ndif_llama.trace(TEXT, capture=SITES,
                                                                                          interventions=every)
    assert theirs.logprobs.shape == (3, 4)
    _assert_traces_equal(theirs, ours)
    for name in EDITS:
        without = llama.trace(TEXT, interventions=[iv for n, iv in EDITS.items() if n != name] + MASKS)
        assert not torch.equal(without.logprobs.nan_to_num(), ours.logprobs.nan_to_num()), name
    for row in (1, 2):  # a masked row differs from the unmasked row 0 (the site edits act on every row)
        assert not torch.equal(ours.activations["mlp_out.1"][row], ours.activations["mlp_out.1"][0])
    # the steering term acts on prompt positions >= 1: its report is |2 v| there and NaN at position 0
    fired = theirs.fired["up"][0]
    assert torch.isnan(fired[0])
    torch.testing.assert_close(fired[1:], torch.full((len(fired) - 1,), float(2 * _vector(2).norm())))


def test_capture_batch_with_per_row_scales_and_masks_equals_the_engine(llama, ndif_llama):
    seqs = [llama.encode("one two three"), llama.encode("four five six seven eight")]
    edit = [AddVector("resid_post.0", _vector(), scale=[1.0, -1.0]), RowMask([1], rows=[1]),
            MaskAttention([0], queries=[2], layers=[0])]
    ours = llama.capture_batch(seqs, SITES, interventions=edit)
    theirs = ndif_llama.capture_batch(seqs, SITES, interventions=edit)
    picked = ndif_llama.capture_batch(seqs, SITES, interventions=edit, positions=[[0, 2], [4]])
    plain = llama.capture_batch(seqs, SITES, interventions=edit[:1])
    for site in SITES:
        torch.testing.assert_close(theirs[site], ours[site], atol=0, rtol=0)
        torch.testing.assert_close(picked[site], torch.stack([ours[site][0, 0], ours[site][0, 2], ours[site][1, 4]]))
    assert not torch.equal(plain["mlp_out.1"], ours["mlp_out.1"])  # the masks acted


@pytest.mark.parametrize("case", ["steered", "sampled batch"])  # greedy: through the server, below
def test_generate_equals_the_engine_record_for_record(llama, ndif_llama, case):
    kwargs = {
        "steered": dict(prompt="one two three",
                        interventions=[Additive("resid_post.0", _vector(), strength=2.0, term="up", tokens="generated")]),
        "sampled batch": dict(prompts=["one two", "three four five six"], n_samples=2,
                              sampling=Sampling(temperature=0.8), seed=3),
    }[case]
    ours = list(llama.generate(max_new_tokens=5, capture=["resid_post.1"], **kwargs))
    theirs = list(ndif_llama.generate(max_new_tokens=5, capture=["resid_post.1"], **kwargs))
    assert [(r.batch_index, r.token_id) for r in theirs] == [(r.batch_index, r.token_id) for r in ours]
    for a, b in zip(ours, theirs):
        assert (b.logprob, b.entropy, b.top_ids, b.fired, b.finished) == (a.logprob, a.entropy, a.top_ids, a.fired,
                                                                         a.finished)
        torch.testing.assert_close(b.activations["resid_post.1"], a.activations["resid_post.1"], atol=0, rtol=0)
    if case == "steered":  # a generated-only term: nothing at the first token, |2 v| from the second on
        assert ours[0].fired == {} and ours[1].fired["up"] == pytest.approx(float(2 * _vector().norm()), rel=1e-6)


def test_readout_and_logit_lens_equal_the_engine(llama, ndif_llama):
    from analyses.logit_lens import logit_lens, trace_completion

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    for norm in (True, False):
        ours, theirs = llama.readout(x, norm=norm, token_ids=[1, 2, 3]), ndif_llama.readout(x, norm=norm, token_ids=[1, 2, 3])
        assert torch.equal(theirs.top_ids, ours.top_ids) and torch.equal(theirs.token_ranks, ours.token_ranks)
        torch.testing.assert_close(theirs.top_logits, ours.top_logits, atol=0, rtol=0)
    # the lens page's path: a completion trace, then every layer read out. ndif: skips the attention patterns
    # (refused); the engine is asked for none either, since eager attention (which patterns need) rounds
    # differently from sdpa
    ours = trace_completion(llama, "one two three", [5, 6], attention=False)
    theirs = trace_completion(ndif_llama, "one two three", [5, 6])
    assert not any(name.startswith("attn_pattern") for name in theirs.trace.activations)
    lens_ours, lens_theirs = logit_lens(ours.trace, llama), logit_lens(theirs.trace, ndif_llama)
    np.testing.assert_equal(lens_theirs.to_dict(), lens_ours.to_dict())  # NaN (the last position) equals NaN


def test_router_sites_of_an_moe_equal_the_engine(moe):
    ndif_moe = Engine(rehearse(moe.handle))
    assert ndif_moe.capabilities()["router"]
    sites = ["router.0", "experts.0", "expert_gates.0", "resid_post.1"]
    ours = moe.trace("one two three", capture=sites)
    theirs = ndif_moe.trace("one two three", capture=sites)
    for site in sites:
        torch.testing.assert_close(theirs.activations[site], ours.activations[site], atol=0, rtol=0)


def test_a_router_rule_call_leaves_the_nnsight_wrapper_in_place(moe):
    """A call with a router rule replaces the router's forward for that call only; whatever held the module's
    instance slot before (nnsight's controller, installed for good once the model has been traced through
    nnsight) is back after it, so a rehearsal after the call still sees the router. (The call used to delete
    the slot: every later nnsight trace of the session's MoE raised OutOfOrderError at the router.)"""
    from probes.routing import TopK

    ndif_moe = Engine(rehearse(moe.handle))
    sites = ["router.0", "resid_post.1"]
    first = ndif_moe.trace("one two three", capture=sites)  # nnsight now holds every module's forward slot
    gate = moe.model.model.layers[0].mlp.gate
    held = gate.__dict__.get("forward")
    assert held is not None
    ruled = list(moe.generate("one two", max_new_tokens=3, interventions=[TopK(k=1)]))
    assert len(ruled) == 3 and gate.__dict__.get("forward") is held
    again, ours = ndif_moe.trace("one two three", capture=sites), moe.trace("one two three", capture=sites)
    for site in sites:
        torch.testing.assert_close(again.activations[site], ours.activations[site], atol=0, rtol=0)
        torch.testing.assert_close(again.activations[site], first.activations[site], atol=0, rtol=0)


# ----- what an ndif: backend refuses, and why


def test_capabilities_say_served_recomputed_or_refused_with_a_reason(ndif_llama):
    from probes.engine import CAPABILITIES
    from probes.ndif import capability_report

    rows = {r["capability"]: r for r in capability_report(ndif_llama.handle)}
    assert set(rows) == set(CAPABILITIES) and all(r["reason"] for r in rows.values())
    assert {n for n, r in rows.items() if r["verdict"] != "refused"} == {
        "trace", "capture_batch", "interventions", "generate", "readout"}  # router: a dense model has none
    assert rows["generate"]["verdict"] == "recomputed" and "not streamed" in rows["generate"]["reason"]
    assert ndif_llama.capabilities() == {n: r["verdict"] != "refused" for n, r in rows.items()}


def test_refused_capabilities_name_which_and_why(llama, ndif_llama):
    from probes.backend import require

    with pytest.raises(BadInputError, match="cannot do fork, grad on this backend .fork: prefix states"):
        require(ndif_llama, "fork", "grad")
    with pytest.raises(BadInputError, match="prefill is refused on ndif-local:tiny-random:llama, which runs on NDIF"):
        ndif_llama.prefill("hello")
    with pytest.raises(BadInputError, match="capturing attn_pattern.0 is refused .* eager attention"):
        ndif_llama.trace("hello there", capture=["attn_pattern.0"])
    with pytest.raises(BadInputError, match="SinkRecent .kv_sink_recent. is refused .* KV policies"):
        list(ndif_llama.generate("hello there", max_new_tokens=2, interventions=[SinkRecent(sink=1, recent=2)]))
    with pytest.raises(BadInputError, match="capture_batch with a prefix state is refused"):
        ndif_llama.capture_batch([[1, 2, 3]], ["resid_post.0"], prefix=llama.prefill([1, 2]))


def test_a_missing_ndif_key_is_refused_before_any_network(monkeypatch):
    from nnsight import CONFIG

    from probes.zoo import load_model

    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(CONFIG.API, "APIKEY", None)
    with pytest.raises(ModelLoadError, match="ndif: models need an NDIF API key.*export NDIF_API_KEY"):
        load_model("ndif:meta-llama/Llama-3.1-8B")


def test_ndif_local_model_ids_open_the_rehearsal():
    from probes.zoo import load_model

    with pytest.raises(BadInputError, match="ndif-local: takes a zoo model id"):
        load_model("ndif-local:ndif:meta-llama/Llama-3.1-8B")


@pytest.mark.model
def test_smollm2_through_the_rehearsal_equals_the_engine(smollm2):
    ndif_smol = Engine(rehearse(smollm2.handle))
    d = smollm2.arch().d_model
    edit = [AddVector("resid_post.10", torch.randn(d, generator=torch.Generator().manual_seed(0)), scale=4.0)]
    sites = ["resid_post.3", "mlp_out.10", "z.20"]
    ours = smollm2.trace("What is 2 + 3?", capture=sites, interventions=edit, chat=True)
    theirs = ndif_smol.trace("What is 2 + 3?", capture=sites, interventions=edit, chat=True)
    for site in sites:
        torch.testing.assert_close(theirs.activations[site], ours.activations[site], atol=0, rtol=0)
    torch.testing.assert_close(theirs.logprobs, ours.logprobs, atol=0, rtol=0, equal_nan=True)
    gen_ours = list(smollm2.generate("What is 2 + 3?", chat=True, max_new_tokens=6, interventions=edit))
    gen_theirs = list(ndif_smol.generate("What is 2 + 3?", chat=True, max_new_tokens=6, interventions=edit))
    assert [r.token_id for r in gen_theirs] == [r.token_id for r in gen_ours]
    assert [r.logprob for r in gen_theirs] == [r.logprob for r in gen_ours]


# ----- the methods' own entry points on the rehearsal backend


def test_method_entry_points_equal_the_engine(llama, ndif_llama):
    """Steering sweeps, RISE step vectors and fuzzy-concept reads take the backend as it is (no method knows
    it is on NDIF). RISE's harvest reuses a prefix state on the engine and runs whole sequences on ndif:
    (no fork): the same numbers up to float rounding, atol 1e-5."""
    from analyses.fuzzy_concepts.harvest import Sample, TextSource
    from analyses.rise.harvest import step_residuals
    from analyses.steering import steering_grid

    direction = _vector(5)
    grids = [steering_grid(b, "one two three", "resid_post.0", direction, [-1.0, 0.0, 2.0], max_new_tokens=2)
             for b in (llama, ndif_llama)]
    assert [grids[1].comparison(s).steered_text for s in (-1.0, 0.0, 2.0)] == \
        [grids[0].comparison(s).steered_text for s in (-1.0, 0.0, 2.0)]
    base = llama.encode("a shared prefix of more than eight tokens in every row")
    seqs = [base + llama.encode(" one two", add_special_tokens=False), base + llama.encode(" three", add_special_tokens=False)]
    positions = [[len(base), len(base) + 1], [len(base)]]
    ours, theirs = (step_residuals(b, seqs, positions, layers=[0, 1]) for b in (llama, ndif_llama))
    for a, b in zip(ours, theirs):
        for site in a:
            torch.testing.assert_close(b[site], a[site], atol=1e-5, rtol=0)
    samples = [Sample(id="s0", key="k0", ids=seqs[0], position=len(base) + 1, text="one two", span=(4, 7))]
    source = TextSource(word="two", kind="texts", texts=("one two",))
    torch.testing.assert_close(source.read(ndif_llama, samples, "resid_post.1"), source.read(llama, samples, "resid_post.1"),
                               atol=0, rtol=0)


def test_router_maps_of_a_generation_equal_the_engine(moe):
    from analyses.moe_router.maps import generation_map

    ours = generation_map(moe, "one two three", max_new_tokens=2)
    theirs = generation_map(Engine(rehearse(moe.handle)), "one two three", max_new_tokens=2)
    np.testing.assert_equal(theirs.to_dict(), ours.to_dict())


def test_visual_attribution_on_a_text_model_is_refused_with_the_reason(ndif_llama):
    from analyses.visual_attribution.attribution import exhaustive_effects

    with pytest.raises(BadInputError, match="cannot do vision on this backend .vision: an ndif: model loads no image"):
        exhaustive_effects(ndif_llama, "a <image> b", None, [[0, 1]], [])


# qwen2_5_vl in the unit tier (pixel values, an image grid, 3-D rotary, token types); the other families under slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", *(pytest.param(f, marks=pytest.mark.slow)
                                                    for f in ("llava", "smolvlm", "qwen2_vl", "qwen3_vl"))])
def test_images_exhaustive_effects_and_capture_batch_of_a_vlm_equal_the_engine(family):
    """Images travel as trace inputs: visual attribution's exhaustive effects (row masks over image tokens,
    one forward) and a right-padded capture_batch with an image per row equal the engine exactly; a
    generation with images is refused with the reason."""
    from analyses.visual_attribution import exhaustive_effects, grid_regions
    from probes.vision import spec_of

    vlm = Engine.from_id(f"tiny-random:{family}", device="cpu")
    ndif_vlm = Engine(rehearse(vlm.handle))
    assert ndif_vlm.capabilities()["vision"]
    image = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    text = "a b <image> c d e f g"
    n = len(vlm.trace(text, images=[image]).token_ids)
    spans, regions = [(1, 2), (n - 5, n)], grid_regions(spec_of(vlm), 2, 2)
    ours, theirs = (exhaustive_effects(b, text, image, spans, regions) for b in (vlm, ndif_vlm))
    np.testing.assert_array_equal(theirs, ours)
    assert np.all(ours[0] == 0.0) and np.abs(ours[1]).min() > 1e-4  # "b" precedes the image; the tail reads it
    seqs = [vlm.encode("a <image> b c"), vlm.encode("d <image> e")]
    batch_ours, batch_theirs = (b.capture_batch(seqs, SITES, images=[image, image]) for b in (vlm, ndif_vlm))
    for site in SITES:
        torch.testing.assert_close(batch_theirs[site], batch_ours[site], atol=0, rtol=0)
    with pytest.raises(BadInputError, match="generate with images is refused on ndif-local:tiny-random:"):
        ndif_vlm.generate(text, images=[image], max_new_tokens=2)


def test_ndif_local_overhead_row(llama):
    from probes.ndif_bench import bench_ndif_local_overhead

    row = bench_ndif_local_overhead(llama, repeats=1, tokens=16)
    assert row["bench"] == "ndif_local_overhead" and row["sites"] == ["resid_post.1", "mlp_out.1", "attn_out.1"]
    assert row["ratio"] == pytest.approx(row["ndif_local_s"] / row["engine_s"], rel=2e-3)


# ----- thoughtscope serve on an ndif: backend (the server in this process over the rehearsal engine)


@pytest.fixture(scope="module")
def ndif_served(ndif_llama):
    """`thoughtscope serve` over the rehearsal engine, in this process."""
    with serving_in_thread(create_app(ndif_llama)) as url:
        yield url


def test_the_server_serves_an_ndif_backend_and_refuses_with_the_reason(llama, ndif_served):
    """trace (with a mask), capture_batch and generate through `serve` on an ndif: backend equal the engine;
    the stream delivers the records after the run; a refused capability is a 400 naming which and why."""
    import httpx

    from probes.client import RemoteBackend

    mask = [MaskAttention([1], queries=[3]), AddVector("resid_post.0", _vector(), scale=2.0)]
    seqs = [llama.encode("one two three"), llama.encode("four five")]
    with RemoteBackend(ndif_served) as remote:
        assert remote.capabilities() == {**{n: False for n in remote.capabilities()}, "trace": True,
                                         "capture_batch": True, "interventions": True, "generate": True,
                                         "readout": True}
        ours, theirs = llama.trace("one two three four", capture=SITES, interventions=mask), \
            remote.trace("one two three four", capture=SITES, interventions=mask)
        for site in SITES:
            torch.testing.assert_close(theirs.activations[site], ours.activations[site], atol=0, rtol=0)
        torch.testing.assert_close(theirs.logprobs, ours.logprobs, atol=0, rtol=0, equal_nan=True)
        batch_ours, batch_theirs = llama.capture_batch(seqs, SITES), remote.capture_batch(seqs, SITES)
        for site in SITES:
            torch.testing.assert_close(batch_theirs[site], batch_ours[site], atol=0, rtol=0)
        # greedy, record for record (the stream delivers them after the run)
        gen_ours = list(llama.generate("one two three", max_new_tokens=5, capture=["resid_post.1"]))
        gen_theirs = list(remote.generate("one two three", max_new_tokens=5, capture=["resid_post.1"]))
        assert len(gen_theirs) == 5
        for a, b in zip(gen_ours, gen_theirs, strict=True):
            assert (b.batch_index, b.token_id, b.logprob, b.entropy, b.top_ids, b.fired, b.finished) == \
                (a.batch_index, a.token_id, a.logprob, a.entropy, a.top_ids, a.fired, a.finished)
            torch.testing.assert_close(b.activations["resid_post.1"], a.activations["resid_post.1"], atol=0, rtol=0)
        with pytest.raises(BadInputError, match="MaskAttention in generate is refused .* one nnsight generate"):
            remote.generate("one two", max_new_tokens=2, interventions=[MaskAttention([0])])
    with httpx.Client(base_url=ndif_served, timeout=30) as http:
        r = http.post("/prefill", json={"prompt": "hello"})
        assert r.status_code == 400 and "prefill is refused on ndif-local:tiny-random:llama" in r.json()["error"]
        assert "prefix states are KV caches" in r.json()["error"]


# ----- a page on an ndif: model


def test_a_page_needing_a_refused_capability_says_which_and_why(monkeypatch):
    """The CoT entropy page needs prefix states (fork): on ndif-local: it shows the refusal's reason (from
    probes.ndif.VERDICTS) instead of a traceback."""
    from tests import apptest_helpers as helpers

    monkeypatch.setenv("THOUGHTSCOPE_MODEL", "ndif-local:tiny-random:llama")
    at = helpers.open_page("cot_entropy")
    helpers.assert_clean(at)
    text = " ".join(i.value for i in at.info)
    assert "CoT entropy phases is not available here: ndif-local:tiny-random:llama cannot do fork" in text
    assert "prefix states are KV caches held in the process that ran the prefix" in text


def test_the_rehearsal_is_strict_a_by_reference_payload_fails_a_by_value_one_runs():
    """Without thoughtscope (`without_project`) a payload naming a project class by reference cannot load; the
    same object shipped by value (`shipped_by_value`) loads as a rebuilt class with the same fields, and the
    project's modules are back afterwards (the same module objects)."""
    import sys

    import cloudpickle.cloudpickle as cp
    from nnsight.intervention.serialization import dumps, loads

    from probes.ndif import shipped_by_value, without_project
    from probes.sites import Site

    site = Site("resid_post", 1)
    sites_module = sys.modules["probes.sites"]
    by_reference = dumps(site)
    with shipped_by_value():
        by_value = dumps(site)
    by_id, by_class = cp._DYNAMIC_CLASS_TRACKER_BY_ID, cp._DYNAMIC_CLASS_TRACKER_BY_CLASS
    cp._DYNAMIC_CLASS_TRACKER_BY_ID, cp._DYNAMIC_CLASS_TRACKER_BY_CLASS = {}, {}  # as a fresh server process
    try:
        with without_project():
            assert "probes.sites" not in sys.modules
            with pytest.raises(ModuleNotFoundError, match="No module named 'probes"):
                loads(by_reference)
            with pytest.raises(ModuleNotFoundError, match="without thoughtscope installed"):
                __import__("thoughtscope.errors")
            shipped = loads(by_value)
    finally:
        cp._DYNAMIC_CLASS_TRACKER_BY_ID, cp._DYNAMIC_CLASS_TRACKER_BY_CLASS = by_id, by_class
    assert type(shipped) is not Site and type(shipped).__name__ == "Site"
    assert (shipped.name, shipped.layer, shipped.module_path("decoder")) == ("resid_post.1", 1, "model.layers.1")
    assert sys.modules["probes.sites"] is sites_module


def test_a_real_ndif_request_ships_the_project_by_value_only_while_it_serialises(ndif_llama):
    """An ndif: handle's backend is nnsight's NDIF backend (`_remote_backend(True, ...)`) run inside
    `shipped_by_value` (no network here: the nnsight model is a recorder); the by-value registry is back to
    by-reference afterwards (Ray and other cloudpickle users in this process keep pickling the project by
    reference)."""
    import dataclasses

    from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES

    from probes.ndif import backend

    seen = []

    class Recorder:
        def _remote_backend(self, remote, blocking, job_id, verbose):
            seen.append(("built", remote, blocking, job_id, verbose))
            return lambda tracer: seen.append((tracer, sorted(_PICKLE_BY_VALUE_MODULES & {"probes", "thoughtscope"})))

    real = dataclasses.replace(ndif_llama.handle, _extras={"ndif_remote": True, "nnsight": Recorder()})
    backend(real)("tracer")
    assert seen == [("built", True, True, None, False), ("tracer", ["probes", "thoughtscope"])]
    assert not _PICKLE_BY_VALUE_MODULES & {"probes", "thoughtscope"}

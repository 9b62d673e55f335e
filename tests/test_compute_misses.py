"""The three compute targets of issue 28 (fuzzy fit, Expert-Sample, visual attribution's attention rows):
each faster path computes what the direct one computed.

Unit tier: synthetic tensors and tiny random models only.
"""

from __future__ import annotations

import math

import torch

from analyses.fuzzy_concepts import rules as fuzzy_rules
from analyses.fuzzy_concepts.rules import FuzzyRuleLayer


# ----------------------------------------------------------------------------- fuzzy fit: the expanded loss


def _direct_loss(rows, P, C, log_sigma, U, sparsity):
    """The loss as it reads on paper: |wbar U - x|^2 (an [n, d] residual) plus the firing entropy."""
    wbar = torch.softmax(fuzzy_rules._log_memberships(rows @ P.T, C, log_sigma), dim=-1)
    return (wbar @ U - rows).pow(2).sum(1).mean() + sparsity * fuzzy_rules._entropy(wbar).mean()


def test_the_expanded_fit_loss_and_its_gradients_equal_the_direct_residual_form():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 12, generator=g, dtype=torch.float64)
    params = [torch.randn(3, 12, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64),
              0.3 * torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, 12, generator=g, dtype=torch.float64)]
    direct_params = [p.clone().requires_grad_(True) for p in params]
    fused_params = [p.clone().requires_grad_(True) for p in params]
    direct = _direct_loss(rows, *direct_params, sparsity=0.03)
    fused = fuzzy_rules._fit_loss(rows, rows.pow(2).sum(1).mean(), *fused_params, sparsity=0.03)
    direct.backward()
    fused.backward()
    assert math.isclose(float(fused.detach()), float(direct.detach()), rel_tol=1e-12)
    for a, b in zip(fused_params, direct_params):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_a_fit_follows_the_direct_loss_trajectory_step_by_step():
    """The whole Adam run, replayed with the direct residual loss from the same start: the same losses.
    Overlapping clusters, so the loss keeps falling (at a flat optimum Adam's normalised steps turn float32
    rounding into jitter of either form, about 1e-3 relative, and no two summation orders agree there)."""
    g = torch.Generator().manual_seed(1)
    centres = 3 * torch.randn(4, 10, generator=g)
    Z = centres[torch.randint(0, 4, (240,), generator=g)] + 2.0 * torch.randn(240, 10, generator=g)
    layer = FuzzyRuleLayer(n_rules=4, n_features=3, steps=40, tol=0.0, seed=0).fit(Z)

    ref = FuzzyRuleLayer(n_rules=4, n_features=3, steps=40, tol=0.0, seed=0)
    mean, scale = fuzzy_rules.standardiser(Z)
    x = (Z - mean) / scale
    params = ref._init(x, 3)
    for p in params:
        p.requires_grad_(True)
    P, C, log_sigma, U = params
    opt = torch.optim.Adam([{"params": [C, log_sigma], "lr": 0.01}, {"params": [P, U], "lr": 0.01 / math.sqrt(10)}])
    history = []
    for step in range(41):
        loss = _direct_loss(x, P, C, log_sigma, U, 0.03)
        history.append(float(loss.detach()))
        if step == 40:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert layer.n_iter_ == 40 and len(layer.loss_history_) == 41
    assert torch.allclose(torch.tensor(layer.loss_history_), torch.tensor(history), rtol=1e-5, atol=1e-6)
    assert history[0] - history[-1] > 3e-3  # the replay moved (0.3045 -> 0.3006): a trajectory, not 41 copies


# ----------------------------------------------------------------------------- attention rows


def _rows_equal_eager(engine, sequences, positions, extra_sites=(), images=None):
    """capture_batch's rows of every attn_pattern layer (and `extra_sites`) against eager full traces."""
    sites = [f"attn_pattern.{layer}" for layer in range(engine.arch().n_layers)] + list(extra_sites)
    rows = engine.capture_batch(sequences, sites, positions=positions, images=images)
    start = 0
    for b, (seq, pos) in enumerate(zip(sequences, positions)):
        trace = engine.trace(seq, capture=sites, images=None if images is None else [images[b]])
        n = len(trace.token_ids)
        for site in sites:
            got = rows[site][start:start + len(pos)]
            want = trace.activations[site][pos]
            if site.startswith("attn_pattern"):
                assert got.shape == (len(pos), engine.arch().n_heads, rows[site].shape[-1])
                assert float(got[..., n:].abs().sum()) == 0.0  # a shorter row never reads the padding keys
                got = got[..., :n]
            assert torch.allclose(got, want, atol=1e-6), (b, site)
        start += len(pos)
    assert start == rows[sites[0]].shape[0]


def test_attention_rows_equal_eager_probabilities_in_a_padded_batch(llama, moe):
    for engine in (llama, moe):  # 4 query heads over 2 key-value heads: grouped keys
        a, b = engine.encode("one two three four five six seven"), engine.encode("alpha beta gamma")
        _rows_equal_eager(engine, [a, b], [[2, 4, len(a) - 1], [len(b) - 1, 1]], extra_sites=["resid_post.0"])
        assert engine.model.config._attn_implementation == "sdpa"  # restored after the call


def test_attention_rows_end_the_forward_inside_the_deepest_layer_and_skip_the_seq_by_seq_patterns(llama):
    """Counting work: with rows, the last layer's MLP never runs and no attention function returns weights."""
    from probes.sites import Site, get_module

    ids = llama.encode("one two three four five")
    n_layers = llama.arch().n_layers
    mlp = get_module(llama.model, Site("mlp_out", n_layers - 1).module_path(llama.handle.family))
    attn = [get_module(llama.model, Site("attn_pattern", layer).module_path(llama.handle.family))
            for layer in range(n_layers)]
    calls, weights = [], []
    hooks = [mlp.register_forward_hook(lambda *_: calls.append("mlp"))]
    hooks += [m.register_forward_hook(lambda _m, _a, out: weights.append(out[1])) for m in attn]
    try:
        llama.capture_batch([ids], [f"attn_pattern.{layer}" for layer in range(n_layers)], positions=[[3, 4]])
        assert calls == [] and all(w is None for w in weights) and len(weights) == n_layers - 1
        weights.clear()
        llama.trace(ids, capture=[f"attn_pattern.{n_layers - 1}"])  # the full pattern: eager, [1, heads, 5, 5]
        assert calls == ["mlp"] and weights[-1].shape[-2:] == (5, 5)
    finally:
        for h in hooks:
            h.remove()


def test_attention_rows_with_an_image_and_the_features_that_read_them():
    """A VLM: the rows over image and text keys equal eager attention, and `attention_features` from rows
    (no trace given) equals the features read from a full eager trace."""
    import numpy as np

    from analyses.visual_attribution import attention_features, grid_regions
    from probes import Engine
    from probes.vision import spec_of

    llava = Engine.from_id("tiny-random:llava", device="cpu")
    image = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    text = "a b <image> c d e f g"
    n = len(llava.trace(text, images=[image]).token_ids)
    _rows_equal_eager(llava, [llava.encode(text)], [[n - 4, n - 2, n - 1]], images=[image])
    regions = grid_regions(spec_of(llava), 2, 2)
    spans = [(n - 3, n), (n - 5, n - 3)]
    sites = [f"attn_pattern.{layer}" for layer in range(llava.arch().n_layers)]
    from_rows = attention_features(llava, text, image, spans, regions)
    from_trace = attention_features(llava, text, image, spans, regions,
                                    trace=llava.trace(text, capture=sites, images=[image]))
    assert from_rows.shape == (2, 4, llava.arch().n_layers * llava.arch().n_heads)
    assert np.allclose(from_rows, from_trace, atol=1e-6) and float(np.abs(from_rows).sum()) > 0


def test_attention_rows_come_back_as_ordinary_tensors(llama):
    """The rows path runs its forward under inference mode (probes.engine.capture_batch); every tensor it
    returns is made outside it: an ordinary tensor (not an inference tensor) that autograd still takes,
    the other captured sites' rows included."""
    ids = llama.encode("one two three four five")
    out = llama.capture_batch([ids], ["attn_pattern.0", "attn_pattern.1", "resid_post.0"], positions=[[4, 2]])
    assert sorted(out) == ["attn_pattern.0", "attn_pattern.1", "resid_post.0"]
    for t in out.values():
        assert not t.is_inference() and not torch.is_inference_mode_enabled()
        x = t.clone().requires_grad_(True)
        (x * 2).sum().backward()
        assert torch.equal(x.grad, torch.full_like(t, 2.0))


def test_image_preprocessing_equals_the_channel_last_formula_bit_for_bit():
    """`preprocess` normalises channels first (faster); its values are the plain formula's, bit for bit
    (the shipped study is rebuilt byte for byte from them)."""
    import numpy as np
    from PIL import Image

    from probes.vision import VisionSpec, preprocess

    rng = np.random.default_rng(0)
    for size, mean, std in ((64, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
                            (32, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))):
        spec = VisionSpec("llava", 5, size, 8, mean=mean, std=std)
        for shape in ((48, 48, 3), (size, size, 3), (30, 50), (17, 41, 4)):
            image = rng.integers(0, 256, size=shape, dtype=np.uint8)
            img = Image.fromarray(image).convert("RGB")
            if img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BICUBIC)
            x = (np.asarray(img, dtype=np.float64) / 255.0 - np.asarray(mean)) / np.asarray(std)
            want = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1).astype(np.float32)))
            got = preprocess(spec, image)
            assert got.is_contiguous() and got.dtype == torch.float32
            assert got.numpy().tobytes() == want.numpy().tobytes()

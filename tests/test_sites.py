"""The site table: one naming scheme, mapped to module paths and TransformerLens hook names."""

from __future__ import annotations

import pytest

from thoughtscope.errors import UnknownSiteError
from probes.sites import SITE_KINDS, Site, get_module, list_sites, parse_site, site_width, validate_site
from probes.zoo import arch_from_config


def test_parse_and_name_round_trip():
    for name in ["resid_pre.0", "resid_post.12", "attn_out.3", "mlp_out.3", "attn_pattern.1",
                 "q.2", "k.2", "v.2", "z.2", "router.5", "logits"]:
        assert parse_site(name).name == name


def test_module_paths_and_tl_hooks():
    assert Site("resid_post", 3).module_path() == "model.layers.3"
    assert Site("attn_out", 3).module_path() == "model.layers.3.self_attn"
    assert Site("router", 1).module_path() == "model.layers.1.mlp.gate"
    assert Site("z", 0).module_path() == "model.layers.0.self_attn.o_proj"
    assert Site("logits", None).module_path() == "lm_head"
    assert Site("resid_pre", 7).tl_hook() == "blocks.7.hook_resid_pre"
    assert Site("attn_pattern", 2).tl_hook() == "blocks.2.attn.hook_pattern"


def test_every_site_resolves_to_a_module_of_every_tiny_arch(llama, moe):
    for engine in (llama, moe):
        for row in list_sites(engine.handle.arch):
            site = parse_site(row["site"])
            assert get_module(engine.model, site.module_path(engine.handle.family)) is not None


def test_list_sites_counts(llama, moe):
    dense_kinds = len([k for k, s in SITE_KINDS.items() if not s.moe_only])
    assert len(list_sites(llama.handle.arch)) == 2 * dense_kinds + 1
    assert len(list_sites(moe.handle.arch)) == 2 * len(SITE_KINDS) + 1


def test_validation_errors(llama):
    arch = llama.handle.arch
    with pytest.raises(UnknownSiteError, match="layers 0..1"):
        validate_site("resid_post.2", arch)
    with pytest.raises(UnknownSiteError, match="unknown site"):
        parse_site("residpost.1")
    with pytest.raises(UnknownSiteError, match="empty"):
        parse_site("")


def test_arch_from_config_reads_gqa_and_moe(moe):
    arch = arch_from_config(moe.model.config)
    assert arch.is_moe and arch.n_kv_heads == 2 and arch.d_mlp == 32


def test_site_width_is_the_width_a_capture_returns_at_every_site(llama, moe):
    """What the feature browser's command line checks a neuron or a vector against before any model work."""
    for engine in (llama, moe):
        sites = [row["site"] for row in list_sites(engine.handle.arch)]
        captured = engine.trace("Anna has 3 shells.", capture=sites).activations
        for name in sites:
            width = site_width(name, engine.handle.arch)
            first = captured[name][0]  # the first position's values
            if name.startswith("attn_pattern"):
                assert width is None  # [heads, kv_len] grows with the sequence
            else:
                assert width == first.numel(), name
    with pytest.raises(UnknownSiteError, match="no MoE router"):
        site_width("router.0", llama.handle.arch)


@pytest.mark.parametrize("name", [123, None, ["resid_post.0"]])
def test_a_site_name_that_is_not_text_is_named_as_such(name):
    with pytest.raises(UnknownSiteError, match="a site name is text, got"):
        parse_site(name)

"""Amortized visual attribution (METHODS.md method 4; vSTREAM, Kang et al. 2026, arXiv 2604.16587):
which image regions a vision-language model's reasoning spans draw on.

- `regions`: grid blocks, Ward clusters of visual-token features, pixel boxes and masks in image coordinates
  (probes.image_regions maps them to each family's visual tokens), a regions JSON, toy-vlm's object boxes;
- `attribution`: exhaustive causal effects (attention to a region masked in every layer, the drop
  in a span's log-prob; regions batched as rows of one forward), attention features per layer and
  head, the raw-attention and input x gradient baselines;
- `estimator`: `AmortizedAttribution`, the linear 1 - Pearson estimator (fit / predict / save / load);
- `stream`: `stream_attribution`, per-span attention and predicted effects during generation;
- `evaluate`: the toy-vlm faithfulness study behind `thoughtscope eval vis-attr`.

What is built and measured: docs/visual_attribution.md.
"""

from analyses.visual_attribution.attribution import (attention_features, attention_features_batch, check_spans,
                                                     exhaustive_effects, gradient_scores, masked_drops, raw_attention,
                                                     span_logprobs)
from analyses.visual_attribution.estimator import AmortizedAttribution, pearson_loss
from analyses.visual_attribution.regions import (Region, box_regions, cell_map, cluster_regions, grid_regions,
                                                 mask_regions, object_regions, positions, regions_from_json)

__all__ = ["AmortizedAttribution", "Region", "attention_features", "attention_features_batch", "box_regions",
           "cell_map", "check_spans", "cluster_regions", "exhaustive_effects", "gradient_scores", "grid_regions",
           "mask_regions", "masked_drops", "object_regions", "pearson_loss", "positions", "raw_attention",
           "regions_from_json", "span_logprobs"]

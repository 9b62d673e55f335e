"""MoE router tails and Expert-Sample (METHODS.md section 6; Chen et al., arXiv 2602.02443, reconstructed).

- `stats`: sorted router probabilities, head/tail rules (fixed k_h, cumulative probability, largest gap),
  per-token statistics and `RouterProfile` (aggregated over a data set, through any Backend);
- `maps`: router maps over a generation (N samples, any router rule), routing divergence, one token's
  sorted scores with its head/tail split;
- `evaluate`: Expert-Sample chosen on development, pass@n / best-of-n against greedy and temperature
  sampling on evaluation with intervals and paired tests; greedy accuracy as active experts shrink;
- `problems`: the development / evaluation problems (toy-moe's own task, or the shared tasks).

The rules themselves (TopK, ExpertSample, ForceExperts) live in `probes.routing` and travel to a model
server as intervention specs.
"""

from analyses.moe_router.evaluate import (ActiveExpertsReport, ExpertSampleReport, ExpertSetting, Method, Samples,
                                          default_grid, draw_samples, evaluate_active_experts, evaluate_expert_sample)
from analyses.moe_router.maps import RouterMap, generation_map, profile_task, routing_divergence, score_view
from analyses.moe_router.stats import HeadTail, RouterProfile, sorted_probabilities, token_statistics

__all__ = ["ActiveExpertsReport", "ExpertSampleReport", "ExpertSetting", "HeadTail", "Method", "RouterMap",
           "RouterProfile", "Samples", "default_grid", "draw_samples", "evaluate_active_experts",
           "evaluate_expert_sample", "generation_map", "profile_task", "routing_divergence", "score_view",
           "sorted_probabilities", "token_statistics"]

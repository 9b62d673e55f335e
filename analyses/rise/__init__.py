"""RISE: reasoning behaviours as directions in step-level SAEs (Zhang et al., "Fantastic Reasoning
Behaviors and Where to Find Them", arXiv 2512.23988; no official code).

The model writes chain-of-thought traces; each trace is cut into steps, and one teacher-forced
pass reads the residual stream at the token that closes each step, so every step becomes one
vector. An SAE trained on those vectors, with no labels, turns out to hold columns for behaviours
such as reflection and backtracking; their mean decoder direction steers the behaviour.

Pipeline (what is [summary] from a write-up of the paper, what is our [recon]):
1. `harvest`: traces for a problem set, steps split at the model family's delimiter ("\\n\\n"
   [summary]; sentence ends for the embedded SmolLM2 [recon]); one batched teacher-forced pass
   per batch reads `resid_post.L` at each step's closing token [summary]; stored in `cache/` per
   trace (resumable). Optional `augment="templated"` splices generic reflection/backtracking
   sentences into the traces of models too small to produce them [recon].
2. SAEs per layer (`saes.train`, SAELens) [summary].
3. `label_step`: keyword labeller [summary], or any judge callable; labels never train.
4. `associate_columns`, 5. `decoder_geometry`, 6. `behaviour_vectors` (see `columns`) [summary].
7. `steer`: h' = h - alpha w (w.h) at every generated token, or h + c w [summary].
8. `confidence_vectors`: coefficients over decoder columns that minimise next-token entropy
   (the backend's `minimize_entropy`) [summary]; generated positions only [recon].
9. `feature_dashboard`: per latent, top steps, histogram, promoted/suppressed tokens [recon].

`RisePipeline` chains them for the page and the CLI, keeping a seeded share of the traces out of
SAE training so the SAEs are measured on held-out steps (`quality`: explained variance and L0 as
SAELens computes them, best-latent AUROC, held-out silhouette); `saved_saes()` lists the SAEs it
saved. `evaluate` checks RISE against the `toy-reasoner` organism's ground truth (`thoughtscope eval
rise-organism`). Everything runs over a `Backend`: in this process or through `thoughtscope serve`.
"""

from analyses.rise.columns import (ColumnAssociation, LayerAnalysis, RiseAnalysis, analyse, associate_columns,
                                   behaviour_vectors, decoder_geometry)
from analyses.rise.confidence import ConfidenceResult, confidence_vectors
from analyses.rise.dashboard import FeatureDashboard, feature_dashboard
from analyses.rise.harvest import (BACKTRACKING_TEMPLATES, REFLECTION_TEMPLATES, Harvest, HarvestSettings, TraceRecord,
                                   augment_trace, build_prompt, generate_traces, harvest, judge_for, resolve_delimiter,
                                   step_residuals)
from analyses.rise.labels import (BACKTRACKING_KEYWORDS, BEHAVIOURS, LABELS, OTHER, REFLECTION_KEYWORDS,
                                  count_behaviours, label_step)
from analyses.rise.pipeline import RiseOptions, RisePipeline, SavedSAE, TooFewStepsError, default_layers, saved_saes
from analyses.rise.quality import (POOR_EXPLAINED_VARIANCE, latent_auroc, quality_warning, sae_quality,
                                   step_silhouette)
from analyses.rise.steer import SteeringResult, SteeringRow, behaviour_counter, steer, steering_intervention
from analyses.steps import Step, locate_step_tokens, split_steps

__all__ = [
    "POOR_EXPLAINED_VARIANCE", "SavedSAE", "behaviour_counter", "judge_for", "latent_auroc", "quality_warning",
    "sae_quality", "saved_saes", "step_silhouette",
    "BACKTRACKING_KEYWORDS", "BACKTRACKING_TEMPLATES", "BEHAVIOURS", "ColumnAssociation", "ConfidenceResult",
    "FeatureDashboard", "Harvest", "HarvestSettings", "LABELS", "LayerAnalysis", "OTHER", "REFLECTION_KEYWORDS",
    "REFLECTION_TEMPLATES", "RiseAnalysis", "RiseOptions", "RisePipeline", "SteeringResult", "SteeringRow", "Step",
    "TooFewStepsError", "TraceRecord", "analyse", "associate_columns", "augment_trace", "behaviour_vectors",
    "build_prompt", "confidence_vectors", "count_behaviours", "decoder_geometry", "default_layers",
    "feature_dashboard", "generate_traces", "harvest", "label_step", "locate_step_tokens", "resolve_delimiter",
    "split_steps", "steer", "steering_intervention", "step_residuals",
]

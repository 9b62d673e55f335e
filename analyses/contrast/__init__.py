"""Contrast between two sets of reasoning steps (issue 25 item 4): which SAE latents, attention heads and
difference-of-means directions separate them, with effect sizes, bootstrap intervals, a false
discovery rate correction and held-out AUROC (`core`); the steps and the rules that split them (`steps`).

Example:
    >>> from probes import Engine
    >>> from analyses.organism import organism_problems
    >>> engine = Engine.from_id("toy-reasoner:small")
    >>> steps = organism_steps(engine, organism_problems(16, split="dev", size="small"), ["resid_post.1"])
    >>> in_a, in_b, rule = select(steps, "kind:reflection")
    >>> result = contrast(steps.acts, steps.trace, in_a, in_b, [ContrastSite("direction", "resid_post.1")],
    ...                   ContrastSettings(n_resamples=50), rule=rule)
    >>> result.top[0]["site"]
    'direction:resid_post.1'
"""

from analyses.contrast.core import (ContrastResult, ContrastSettings, ContrastSite, auroc, contrast, export_direction,
                                    save_direction, smd)
from analyses.contrast.steps import RULES, StepSet, harvest_steps, organism_steps, select

__all__ = ["RULES", "ContrastResult", "ContrastSettings", "ContrastSite", "StepSet", "auroc", "contrast",
           "export_direction", "harvest_steps", "organism_steps", "save_direction", "select", "smd"]

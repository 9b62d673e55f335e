"""Entropy phases of chain of thought, detected online with CUSUM; early exit and weighted voting.

Method: Xu et al., "Unveiling the Entropy Dynamics of Chain-of-Thought Reasoning" (arXiv
2606.02020; no official code). A trace is cut into steps; at the end of each step an
answer-forcing suffix is appended to a fork of the prefix state and the intermediate answer A_i is
decoded greedily; H_i is the mean token entropy over A_i. Before a change point the H_i follow an
"uncertainty" density f0, after it a "confidence" density f1; a CUSUM test on
Z_i = log f1(H_i) - log f0(H_i) raises an alarm at the first S_i >= h (h = log gamma), and the
model stops thinking and answers A_i. Sampled trajectories vote with their final CUSUM statistic
as weight.

Our reconstruction, where the paper leaves things open [recon]:
- steps: the model family's delimiter (analyses.families, analyses.steps): the paper's paragraph
  boundary for reasoning models, sentence ends for the embedded SmolLM2;
- answer-forcing suffix: per family (" The answer is " / "</think>\\nThe answer is ");
- f0/f1 split: a calibration step is "confident" once its intermediate answer equals the trace's
  final answer and stays equal (see `detector`);
- baselines DEER and Dynasor-CoT use the same probe as ours (see `rules`);
- cost: "generated tokens" are the trace tokens decoded until the exit; a probe costs its suffix
  plus its decoded answer tokens ("tokens with probes" adds them).

The package: `detector` (CUSUM, densities: a KDE by default, the paper's histogram as an option;
the entropy curve), `probing` (forked probes), `rules` (stopping rules, probed traces, generation
with a rule watching), `trace` (one trace for the page), `evaluate` (the harness: every setting
chosen on a development split, each method run once on the evaluation split with bootstrap
intervals and paired tests against vanilla, see `analyses.evaluation`), `settling` (the alarm
against the `toy-reasoner` organism's known settling step), `cli` (`thoughtscope eval
cot-exit|cot-vote|cot-settling`), `bench`.
Everything runs over a `Backend`: in this process or through `thoughtscope serve`.
"""

from analyses.cot_entropy.detector import (CalibrationTrace, CotMonitor, CusumDetector, cusum_path, entropy_per_token,
                                           entropy_thirds, first_alarm, moving_average, silverman_bandwidth)
from analyses.cot_entropy.evaluate import (DEFAULT_DEER_GRID, DEFAULT_H_GRID, DEFAULT_THRESHOLDS, CotExitReport,
                                           MethodSummary, VoteReport, calibration_summary, choose_density,
                                           choose_threshold,
                                           cusum_weighted_vote, default_dynasor_grid, evaluate_cot_exit,
                                           evaluate_cot_vote, fit_detector, majority_vote, pareto_status, pareto_table,
                                           summarise)
from analyses.cot_entropy.probing import LivePrefix, Probe, probe_answer, probe_positions
from analyses.cot_entropy.rules import (HESITATION_WORDS, CusumStop, DeerStop, DynasorStop, ExitResult, ProbedTrace,
                                        StoppingRule, generate_with_early_exit, plan_probes, probe_traces, replay,
                                        run_with_rule)
from analyses.cot_entropy.trace import TraceAnalysis, analysis_from_run, analyze_trace

__all__ = [
    "CalibrationTrace", "CotExitReport", "CotMonitor", "CusumDetector", "CusumStop", "DEFAULT_DEER_GRID",
    "DEFAULT_H_GRID", "DEFAULT_THRESHOLDS", "DeerStop", "choose_density", "choose_threshold", "default_dynasor_grid", "silverman_bandwidth",
    "summarise",
    "DynasorStop", "ExitResult", "HESITATION_WORDS", "LivePrefix", "MethodSummary", "Probe", "ProbedTrace",
    "StoppingRule", "TraceAnalysis", "VoteReport", "analysis_from_run", "analyze_trace", "calibration_summary",
    "cusum_path", "cusum_weighted_vote", "entropy_per_token", "entropy_thirds", "evaluate_cot_exit",
    "evaluate_cot_vote", "first_alarm", "fit_detector", "generate_with_early_exit", "majority_vote", "moving_average",
    "pareto_status", "pareto_table", "plan_probes", "probe_answer", "probe_positions", "probe_traces", "replay",
    "run_with_rule",
]

"""Neuro-fuzzy concepts: readable IF-THEN rules over the hidden states of a target token, grounded in words.

Method 2 of METHODS.md. Source: the ICML 2026 poster "Neuro-Fuzzy Concept Learning for Interpretable Large
Multimodal Models" (only the abstract is public), in the framing of CoX-LMM (Parekh et al., "A Concept-Based
Explainability Framework for Large Multimodal Models", NeurIPS 2024, arXiv 2406.08074), whose semi-NMF
dictionary is the main baseline. Everything below the abstract's level is our reconstruction [recon].

1. `harvest`: Z = `resid_post.l` at a target word, one row per sample, through the Backend into `cache/`
   (text sources now; an image source plugs in through the same `RepresentationSource` shape).
2. `FuzzyRuleLayer`: K Gaussian rules over m projected features, normalised firing, weighted-average
   defuzzification into consequents (the concepts); gradient descent on reconstruction plus an entropy
   penalty on the firing; scikit-learn style; saved as safetensors + JSON.
3. Readable logic: `FuzzyRuleLayer.rules()` (IF-THEN text), `.explain(z)` (firing and rule chain).
4. Grounding: `ground_words` (unembedding readout, stopwords and non-words dropped), `top_samples`.
5. `run_study`: development tuning, fuzzy vs semi-NMF / k-means / PCA over seeds on held-out samples
   through one metric module (`metrics`), 95% intervals and paired tests.

Example:
    >>> from probes import Engine
    >>> backend = Engine.from_id("tiny-random:llama")
    >>> texts = [f"The dog number {i} ran to the {p}." for i, p in enumerate(["park", "sea", "city"] * 8)]
    >>> study = run_study(backend, FuzzyOptions(word="dog", source="texts", texts=tuple(texts), n=24, k=3,
    ...                   seeds=2, layer=1, sparsity_grid=(0.01,), features_grid=(4,), lr_grid=(0.03,),
    ...                   nmf_alpha_grid=(0.05,), steps=50))  # doctest: +SKIP
    >>> study.rules[0].text()  # doctest: +SKIP
    'Rule 1: IF f1 (...) is high (...) ...'
"""

from analyses.fuzzy_concepts.baselines import BASELINES, KMeansConcepts, PCAConcepts, SemiNMFConcepts
from analyses.fuzzy_concepts.grounding import (filter_words, ground_words, is_english_word, is_grounding_word, lexicon,
                                               stopwords, top_samples)
from analyses.fuzzy_concepts.harvest import (CONTEXTS, SOURCES, SOURCES_HELP, TEMPLATES, RepresentationSource,
                                             Representations, Sample, TextSource, check_layer, default_layer, harvest,
                                             locate, word_pattern)
from analyses.fuzzy_concepts.metrics import (active_concepts, adjusted_mutual_information, matched_similarity,
                                             reconstruction_error, seed_interval, word_overlap)
from analyses.fuzzy_concepts.rules import Clause, Explanation, FuzzyRuleLayer, Rule
from analyses.fuzzy_concepts.study import (METHODS, FuzzyOptions, FuzzyStudy, evaluate_model, run_study,
                                           sparse_then_accurate, split_rows)

__all__ = [
    "BASELINES", "CONTEXTS", "Clause", "Explanation", "FuzzyOptions", "FuzzyRuleLayer", "FuzzyStudy", "KMeansConcepts",
    "METHODS", "PCAConcepts", "RepresentationSource", "Representations", "Rule", "SOURCES", "SOURCES_HELP", "Sample", "SemiNMFConcepts",
    "TEMPLATES", "TextSource", "active_concepts", "adjusted_mutual_information", "check_layer",
    "default_layer", "evaluate_model", "filter_words", "ground_words", "harvest", "is_english_word", "is_grounding_word",
    "lexicon", "locate",
    "matched_similarity", "reconstruction_error", "run_study", "seed_interval", "sparse_then_accurate", "split_rows",
    "stopwords", "top_samples", "word_overlap",
]

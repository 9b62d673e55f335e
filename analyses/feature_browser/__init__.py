"""Corpus feature browser: run any direction over a stored corpus and see where it fires (Neuronpedia /
SAEDashboard style [recon]; no paper method, a viewer of what other methods find).

A direction is an SAE latent (one of ours, saved by RISE, or any SAELens-format SAE on disk), a
neuron (a coordinate of the site), or a steering / concept vector (`directions`). A corpus is
shipped or generated (GSM8K questions, solutions or sentences; arithmetic task problems) or the
user's own text (`corpus`). `build_index` runs the corpus through the model once, in batches,
storing the activations at the site in `cache/` (resumable, with progress); `browse` then
answers from the stored rows in well under a second: top-activating contexts with every
token's activation, an activation histogram, and the tokens the direction promotes and
suppresses (`Backend.readout` without the final norm). Everything goes through a `Backend`, in
this process or through `thoughtscope serve`.

Example:
    >>> from probes import Engine
    >>> engine = Engine.from_id("tiny-random:llama")
    >>> index = build_index(engine, load_corpus("gsm8k-sentences", n=50), "resid_post.1", store=None)
    >>> view = browse(index, Neuron(0, "resid_post.1"), engine, k=5)
    >>> [c["rank"] for c in view.contexts]
    [0, 1, 2, 3, 4]
"""

from analyses.feature_browser.browse import FeatureBrowse, browse, context_maxima, token_scores, top_contexts
from analyses.feature_browser.corpus import CORPORA, Corpus, file_corpus, load_corpus, text_corpus
from analyses.feature_browser.directions import Neuron, SAELatent, VectorDirection, sae_latent
from analyses.feature_browser.index import CorpusIndex, IndexSettings, build_index, tokenize_corpus

__all__ = [
    "CORPORA", "Corpus", "CorpusIndex", "FeatureBrowse", "IndexSettings", "Neuron", "SAELatent", "VectorDirection",
    "browse", "build_index", "context_maxima", "file_corpus", "load_corpus", "sae_latent", "text_corpus",
    "token_scores", "tokenize_corpus", "top_contexts",
]

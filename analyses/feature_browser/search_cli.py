"""`thoughtscope features labels|search|tokens`: label an SAE's latents, search them by text, list a text's latents.

    thoughtscope features labels --site resid_post.15 --sae FOLDER --json
    thoughtscope features search "Wait" --site resid_post.15 --sae FOLDER --k 10 --json
    thoughtscope features tokens "Wait , let me check" --site resid_post.1 --sae FOLDER --model toy-reasoner:small

Labels are built over a corpus index (the same `--corpus` options as `features top`) and kept beside
the SAE (`labels.thoughtscope.json`); a search reads them back. Every hit names the latent and the
feature browser link that opens it (`?latent=J`); output (JSON with --json) carries the provenance record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import typer

from analyses.clikit import MODEL_OPTION, SERVER_OPTION, TOKEN_OPTION, TerminalProgress, backend, emit
from analyses.feature_browser import CORPORA, IndexSettings, build_index
from analyses.feature_browser.index import check_site
from analyses.feature_browser.labels import labels_for
from analyses.feature_browser.search import LabelSearch, check_query
from analyses.feature_browser.token_latents import check_sae, trace_latents
from saes.io import is_sae_folder, load_sae
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance, with_provenance

CorpusOf = Callable[[str, Optional[int], str], Any]  # (name or file, first n texts, unit) -> Corpus


def site_check(site: str) -> str:
    """`--site`, checked as typed (a site the feature browser reads); its layer is checked once the model is known."""
    return check_site(site)


def corpus_check(name: str) -> str:
    """`--corpus`, checked as typed: a shipped corpus or a text file that exists."""
    if name not in CORPORA and not checks.user_path("--corpus", name).is_file():
        raise BadInputError(f"--corpus {name!r} is neither a corpus ({', '.join(CORPORA)}) nor a text file")
    return name


def sae_from_option(folder: str, flag: str = "--sae") -> Any:
    """The SAE in the folder `flag` names (loaded before the model, so a wrong folder costs no model load)."""
    path = checks.user_path(flag, folder)
    if not path.exists():
        raise BadInputError(f"{flag} {folder}: no such folder; give a SAELens SAE folder "
                            "(cfg.json + sae_weights.safetensors)")
    if not is_sae_folder(path):
        raise BadInputError(f"{flag} {folder} is not a SAELens SAE folder: it needs cfg.json and "
                            "sae_weights.safetensors")
    return load_sae(path)


SAE_OPTION = typer.Option(..., "--sae", help="SAELens folder (cfg.json + sae_weights.safetensors)")
SITE_OPTION = typer.Option(..., "--site", help="the SAE's hook site, e.g. resid_post.15", callback=site_check)
CORPUS_OPTION = typer.Option("gsm8k-questions", "--corpus", help="a corpus name or a UTF-8 text file",
                             callback=corpus_check)
N_OPTION = typer.Option(None, "--n", min=1, help="keep the first n texts")
MAX_TOKENS_OPTION = typer.Option(64, "--max-tokens", min=2, help="tokens per context (longer texts: windows)")


def latent_link(latent: int, site: str) -> str:
    """The feature browser's address of one latent (the page reads `latent` and `site` from the URL)."""
    return f"/feature_browser?site={site}&latent={latent}"


def _labels(b: Any, corpus_of: CorpusOf, corpus: str, n: Optional[int], site: str, sae_folder: str, sae: Any,
            max_tokens: int) -> tuple[Any, Any]:
    check_sae(sae, b, site)
    c = corpus_of(corpus, n, "paragraph")
    with TerminalProgress() as progress:
        index = build_index(b, c, site, IndexSettings(max_tokens=max_tokens),
                            on_progress=lambda done, total: progress("index", done, total))
        labels = labels_for(sae_folder, sae, index, b, on_progress=progress)
    return index, labels


def register_search(app: typer.Typer, corpus_of: CorpusOf) -> None:
    """Add the commands to the `features` group; `corpus_of(name, n, unit)` is the group's corpus reader."""

    @app.command("labels")
    def labels_cmd(site: str = SITE_OPTION, sae: str = SAE_OPTION, corpus: str = CORPUS_OPTION,
                   n: Optional[int] = N_OPTION, max_tokens: int = MAX_TOKENS_OPTION,
                   k: int = typer.Option(20, "--k", min=1, help="latents to list"),
                   model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION,
                   token: Optional[str] = TOKEN_OPTION, as_json: bool = typer.Option(False, "--json")) -> None:
        """Label every latent (tokens it fires on, top contexts, decoder words); kept beside the SAE."""
        loaded = sae_from_option(sae)
        b = backend(model, server, token)
        index, labels = _labels(b, corpus_of, corpus, n, site, sae, loaded, max_tokens)
        out = {"key": labels.key, "counts": labels.counts(),
               "labels": [{"latent": lab.latent, "summary": lab.summary, "quality": lab.quality,
                           "n_active": lab.n_active} for lab in labels.labels[:k]]}
        record = provenance(b.info(), data=index.corpus.get("name"), split=index.corpus.get("split"),
                            command="thoughtscope features labels", settings={"site": site, "sae": sae})
        emit(with_provenance(out, record), as_json)

    @app.command("search")
    def search_cmd(query: str = typer.Argument(..., help="words to look for in the labels and top contexts"),
                   site: str = SITE_OPTION, sae: str = SAE_OPTION, corpus: str = CORPUS_OPTION,
                   n: Optional[int] = N_OPTION, max_tokens: int = MAX_TOKENS_OPTION,
                   k: int = typer.Option(10, "--k", min=1, help="hits to list"),
                   model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION,
                   token: Optional[str] = TOKEN_OPTION, as_json: bool = typer.Option(False, "--json")) -> None:
        """Latents whose labels match the query best (TF-IDF), each with its feature browser link."""
        check_query(query)
        loaded = sae_from_option(sae)
        b = backend(model, server, token)
        index, labels = _labels(b, corpus_of, corpus, n, site, sae, loaded, max_tokens)
        hits = [{**hit.to_dict(), "link": latent_link(hit.latent, site)}
                for hit in LabelSearch(labels).search(query, k=k)]
        record = provenance(b.info(), data=index.corpus.get("name"), split=index.corpus.get("split"),
                            command="thoughtscope features search",
                            settings={"site": site, "sae": sae, "query": query, "k": k,
                                      "sae_sha256": labels.key["sae_sha256"]})
        emit(with_provenance({"query": query, "hits": hits}, record), as_json)

    @app.command("tokens")
    def tokens_cmd(text: str = typer.Argument(..., help="the text whose tokens to read"),
                   site: str = SITE_OPTION, sae: str = SAE_OPTION,
                   k: int = typer.Option(10, "--k", min=1, help="latents to list, overall and per token"),
                   model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION,
                   token: Optional[str] = TOKEN_OPTION, as_json: bool = typer.Option(False, "--json")) -> None:
        """The top latents of a text and the latents active at each of its tokens."""
        loaded = sae_from_option(sae)
        b = backend(model, server, token)
        found = trace_latents(b, b.encode(text), loaded, site)
        out = {"tokens": found.tokens, "top": found.top_of_trace(k),
               "per_token": [found.at_token(p, k) for p in range(len(found.tokens))]}
        record = provenance(b.info(), data="text", command="thoughtscope features tokens",
                            settings={"site": site, "sae": sae, "k": k})
        emit(with_provenance(out, record), as_json)

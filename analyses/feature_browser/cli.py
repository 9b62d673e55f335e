"""`thoughtscope features ...`: index a corpus and browse a direction from the command line.

    thoughtscope features index --corpus gsm8k-sentences --site resid_post.15
    thoughtscope features top --corpus gsm8k-sentences --site resid_post.15 --sae FOLDER --latent 12 --json
    thoughtscope features top --corpus notes.txt --site resid_post.15 --neuron 300 --k 10
    thoughtscope features top --corpus gsm8k-questions --site resid_post.15 --vector v.safetensors

`--corpus` is a shipped or generated corpus (gsm8k-questions, gsm8k-solutions, gsm8k-sentences,
arith-problems) or a UTF-8 text file. The index goes into the cache the app uses, so the page and
the command share it. Output (JSON with --json) carries the provenance record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from analyses.clikit import MODEL_OPTION, SERVER_OPTION, TOKEN_OPTION, TerminalProgress, backend, emit, group, path_check
from analyses.feature_browser import (CORPORA, IndexSettings, Neuron, VectorDirection, browse, build_index,
                                      file_corpus, load_corpus, sae_latent)
from analyses.feature_browser.search_cli import register_search
from probes.interventions import load_vector
from probes.sites import site_width
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance, with_provenance

CORPUS_OPTION = typer.Option("gsm8k-questions", "--corpus", help="a corpus name or a UTF-8 text file")
SITE_OPTION = typer.Option(..., "--site", help="hook site, e.g. resid_post.15")


def _corpus(name: str, n: Optional[int], unit: str) -> Any:
    if name in CORPORA:
        return load_corpus(name, n=n)
    if checks.user_path("--corpus", name).is_file():
        corpus = file_corpus(name, unit)
        return corpus if n is None else type(corpus)(corpus.name, corpus.texts[:n], corpus.split, corpus.source)
    raise BadInputError(f"--corpus {name!r} is neither a corpus ({', '.join(CORPORA)}) nor a text file")


def _direction(site: str, sae: Optional[str], latent: int, neuron: Optional[int], vector: Optional[Path],
               tensor: Optional[str]) -> Any:
    given = [x is not None for x in (sae, neuron, vector)]
    if sum(given) != 1:
        raise BadInputError("give exactly one direction: --sae FOLDER --latent N, --neuron N, or --vector FILE")
    if sae is not None:
        return sae_latent(sae, latent, site)
    if neuron is not None:
        return Neuron(neuron, site)
    return VectorDirection(load_vector(vector, tensor), site, Path(vector).name)


def register(cli: typer.Typer) -> None:
    app = group(cli, "features", "Corpus feature browser: where a direction fires over a stored corpus.")

    register_search(app, _corpus)  # labels, search, tokens

    @app.command("index")
    def index_cmd(corpus: str = CORPUS_OPTION, site: str = SITE_OPTION,
                  n: Optional[int] = typer.Option(None, "--n", help="keep the first n texts"),
                  max_tokens: int = typer.Option(64, "--max-tokens", help="tokens per context (longer texts: windows)"),
                  unit: str = typer.Option("paragraph", "--unit", help="a text file: one context per paragraph or line"),
                  model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
                  as_json: bool = typer.Option(False, "--json")) -> None:
        """Run the corpus through the model once and store its activations at the site (resumable)."""
        b = backend(model, server, token)
        c = _corpus(corpus, n, unit)
        with TerminalProgress() as progress:
            index = build_index(b, c, site, IndexSettings(max_tokens=max_tokens),
                                on_progress=lambda done, total: progress("index", done, total))
        record = provenance(b.info(), data=c.name, split=c.split, settings={"site": site, "max_tokens": max_tokens},
                            command="thoughtscope features index")
        emit(with_provenance(index.describe(), record), as_json)

    @app.command("top")
    def top_cmd(corpus: str = CORPUS_OPTION, site: str = SITE_OPTION,
                n: Optional[int] = typer.Option(None, "--n", help="keep the first n texts"),
                max_tokens: int = typer.Option(64, "--max-tokens"),
                unit: str = typer.Option("paragraph", "--unit"),
                sae: Optional[str] = typer.Option(None, "--sae", help="SAELens folder", callback=path_check("--sae")),
                latent: int = typer.Option(0, "--latent", help="latent of --sae"),
                neuron: Optional[int] = typer.Option(None, "--neuron", help="a coordinate of the site"),
                vector: Optional[Path] = typer.Option(None, "--vector", help=".safetensors file with the vector",
                                                      callback=path_check("--vector")),
                tensor: Optional[str] = typer.Option(None, "--tensor", help="tensor name in --vector"),
                k: int = typer.Option(20, "--k", min=1, help="top contexts"),  # said before the corpus is indexed
                model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
                as_json: bool = typer.Option(False, "--json")) -> None:
        """The top contexts of a direction, its histogram and the logits it promotes and suppresses."""
        b = backend(model, server, token)
        c = _corpus(corpus, n, unit)
        direction = _direction(site, sae, latent, neuron, vector, tensor)
        width = site_width(site, b.arch())  # a wrong neuron, latent or width is refused before the corpus runs
        if width is not None:
            direction.check(width)
        with TerminalProgress() as progress:
            index = build_index(b, c, site, IndexSettings(max_tokens=max_tokens),
                                on_progress=lambda done, total: progress("index", done, total))
        view = browse(index, direction, b, k=k)
        record = provenance(b.info(), data=c.name, split=c.split, command="thoughtscope features top",
                            settings={"site": site, "index": index.describe(), "direction": direction.describe(), "k": k})
        emit(with_provenance(view.to_dict(), record), as_json)

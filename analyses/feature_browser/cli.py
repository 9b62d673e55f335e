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
from analyses.feature_browser import (CORPORA, IndexSettings, Neuron, SAELatent, VectorDirection, browse, build_index,
                                      file_corpus, load_corpus)
from analyses.feature_browser.index import BROWSABLE_KINDS
from analyses.feature_browser.search_cli import (CORPUS_OPTION, MAX_TOKENS_OPTION, N_OPTION, register_search,
                                                 sae_from_option, site_check)
from probes.interventions import load_vector
from probes.sites import site_width
from thoughtscope import checks
from thoughtscope.errors import BadInputError
from thoughtscope.provenance import provenance, with_provenance

SITE_OPTION = typer.Option(..., "--site", help=f"hook site: {', '.join(k + '.<layer>' for k in BROWSABLE_KINDS)}",
                           callback=site_check)
UNITS = ("paragraph", "line")
UNIT_OPTION = typer.Option("paragraph", "--unit", help="a text file: one context per paragraph or line",
                           callback=lambda unit: checks.choice("--unit", unit, UNITS))


def _corpus(name: str, n: Optional[int], unit: str) -> Any:
    if name in CORPORA:
        return load_corpus(name, n=n)
    if checks.user_path("--corpus", name).is_file():
        corpus = file_corpus(name, unit)
        return corpus if n is None else type(corpus)(corpus.name, corpus.texts[:n], corpus.split, corpus.source)
    raise BadInputError(f"--corpus {name!r} is neither a corpus ({', '.join(CORPORA)}) nor a text file")


def _direction(site: str, sae: Optional[str], latent: Optional[int], neuron: Optional[int], vector: Optional[Path],
               tensor: Optional[str]) -> Any:
    """The one direction the options name, read from disk before the model loads."""
    given = [x is not None for x in (sae, neuron, vector)]
    if sum(given) != 1:
        raise BadInputError("give exactly one direction: --sae FOLDER --latent N, --neuron N, or --vector FILE")
    if latent is not None and sae is None:
        raise BadInputError("--latent picks a latent of --sae; give --sae FOLDER with it, or drop --latent")
    if tensor is not None and vector is None:
        raise BadInputError("--tensor names a tensor in --vector; give --vector FILE with it, or drop --tensor")
    if sae is not None:
        return SAELatent(sae_from_option(sae), 0 if latent is None else latent, site, str(sae))
    if neuron is not None:
        return Neuron(neuron, site)
    assert vector is not None
    return VectorDirection(_vector(vector, tensor), site, Path(vector).name)


def _vector(path: Path, tensor: Optional[str]) -> Any:
    """The tensor of a .safetensors file; a file of several tensors needs `--tensor` (load_vector says key=)."""
    path = checks.user_path("--vector", path)
    if not path.is_file():
        raise BadInputError(f"--vector {path}: no such file; give a .safetensors file holding the vector")
    if tensor is None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                names = sorted(f.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError):
            names = None  # not safetensors: load_vector says so
        if names == []:
            raise BadInputError(f"{path.name} holds no tensor; save the vector with "
                                "safetensors.torch.save_file({'vector': v}, path)")
        if names is not None and len(names) > 1:
            raise BadInputError(f"{path.name} holds {names}; say which one with --tensor NAME")
    return load_vector(path, tensor)


def register(cli: typer.Typer) -> None:
    app = group(cli, "features", "Corpus feature browser: where a direction fires over a stored corpus.")

    register_search(app, _corpus)  # labels, search, tokens

    @app.command("index")
    def index_cmd(corpus: str = CORPUS_OPTION, site: str = SITE_OPTION, n: Optional[int] = N_OPTION,
                  max_tokens: int = MAX_TOKENS_OPTION, unit: str = UNIT_OPTION,
                  model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
                  as_json: bool = typer.Option(False, "--json")) -> None:
        """Run the corpus through the model once and store its activations at the site (resumable)."""
        c = _corpus(corpus, n, unit)
        b = backend(model, server, token)
        with TerminalProgress() as progress:
            index = build_index(b, c, site, IndexSettings(max_tokens=max_tokens),
                                on_progress=lambda done, total: progress("index", done, total))
        record = provenance(b.info(), data=c.name, split=c.split, settings={"site": site, "max_tokens": max_tokens},
                            command="thoughtscope features index")
        emit(with_provenance(index.describe(), record), as_json)

    @app.command("top")
    def top_cmd(corpus: str = CORPUS_OPTION, site: str = SITE_OPTION, n: Optional[int] = N_OPTION,
                max_tokens: int = MAX_TOKENS_OPTION, unit: str = UNIT_OPTION,
                sae: Optional[str] = typer.Option(None, "--sae", help="SAELens folder", callback=path_check("--sae")),
                latent: Optional[int] = typer.Option(None, "--latent", help="latent of --sae (default 0)"),
                neuron: Optional[int] = typer.Option(None, "--neuron", help="a coordinate of the site"),
                vector: Optional[Path] = typer.Option(None, "--vector", help=".safetensors file with the vector",
                                                      callback=path_check("--vector")),
                tensor: Optional[str] = typer.Option(None, "--tensor", help="tensor name in --vector"),
                k: int = typer.Option(20, "--k", min=1, help="top contexts"),  # said before the corpus is indexed
                model: str = MODEL_OPTION, server: Optional[str] = SERVER_OPTION, token: Optional[str] = TOKEN_OPTION,
                as_json: bool = typer.Option(False, "--json")) -> None:
        """The top contexts of a direction, its histogram and the logits it promotes and suppresses."""
        direction = _direction(site, sae, latent, neuron, vector, tensor)
        c = _corpus(corpus, n, unit)
        b = backend(model, server, token)
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

"""A deliberately wrong analysis: `make test-types` passes only if mypy REJECTS this file.

It reaches past the Backend (`backend.model`: a page or an analysis never touches the model's modules)
and calls a Backend method with a keyword the protocol does not have. Not a test module (pytest does not
collect it) and not in any package; each line below marked `expect:` must be reported.
"""

from __future__ import annotations

from probes.backend import Backend


def reaches_past_the_backend(backend: Backend) -> int:
    layers = backend.model.config.num_hidden_layers  # expect: "Backend" has no attribute "model"
    return int(layers)


def wrong_keyword(backend: Backend) -> list[str]:
    return [r.text for r in backend.generate("2 + 2 =", foo=1)]  # expect: Unexpected keyword argument "foo"


def typed_arch_fact(backend: Backend) -> str:
    return backend.arch().n_layer  # expect: "ArchInfo" has no attribute "n_layer"

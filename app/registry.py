"""The page registry: a page is one module in `app/pages/` that defines `PAGE` and `render(ctx)`.

Adding an analysis page means adding one module; a page whose module is absent does not appear.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass


@dataclass(frozen=True)
class PageSpec:
    title: str
    icon: str = ":material/analytics:"
    order: int = 50  # position in the navigation; Home is 0, the trace explorer 10


def discover_pages() -> list[tuple[PageSpec, object]]:
    """(spec, module) for every module in app.pages that defines PAGE and render, in `order`."""
    import app.pages as pages

    found = []
    for info in pkgutil.iter_modules(pages.__path__):
        module = importlib.import_module(f"app.pages.{info.name}")
        if hasattr(module, "PAGE") and hasattr(module, "render"):
            found.append((module.PAGE, module))
    return sorted(found, key=lambda item: (item[0].order, item[0].title))

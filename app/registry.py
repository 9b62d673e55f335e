"""The page registry: a page is one module in `app/views/` that defines `PAGE` and `render(ctx)`.

Adding an analysis page means adding one module; a page whose module is absent does not appear.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from types import ModuleType

import app.views as views


@dataclass(frozen=True)
class PageSpec:
    """A page's title, icon, place in the navigation (Home 0, the trace explorer 10), and the backend
    capabilities it needs (`Backend.capabilities()`): the frame checks them, the page never probes."""

    title: str
    icon: str = ":material/analytics:"
    order: int = 50
    requires: tuple[str, ...] = ()


def discover_pages() -> list[tuple[PageSpec, ModuleType]]:
    """(spec, module) for every module in app.views that defines PAGE and render, in `order`."""
    found = []
    for info in pkgutil.iter_modules(views.__path__):
        module = importlib.import_module(f"app.views.{info.name}")
        if hasattr(module, "PAGE") and hasattr(module, "render"):
            found.append((module.PAGE, module))
    return sorted(found, key=lambda item: (item[0].order, item[0].title))

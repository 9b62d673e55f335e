"""Rebuild the figure previews the repository ships: `python -m app.ship_previews [--model smollm2-135m]`.

Why: a page's first figure paints as a static preview (app/figure_preview.py) only once the app has drawn that
figure before, so a fresh clone's first visit to each method page waited for plotly.js and the interactive
chart (2.7-3.3 s on the 2-core machine, 2026-12-06) while every later first tab took 1.1-1.8 s. The method
pages open on shipped results, whose first figures are the same on every machine that computes them alike;
their previews ship beside them in `docs/shipped/figure-previews/<plotly version and size>/`, found by each
figure's JSON like any other preview, so a figure that differs here (another plotly, a result recomputed
with other digits) simply finds none and draws its chart as before.

How: the workbench is started on `--model` with an empty cache folder and the shipped previews switched off,
each method page is opened once in a new Chromium tab (as a newcomer would), the app's own preview thread
renders each first figure in its export Chromium, and the PNGs it writes replace the shipped folder's, with
`manifest.json` (files and their sha256, plotly version, model, pages, command, time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app import figure_preview

MANIFEST = "previews.json"  # not shipped.MANIFEST: these are images of results, not results
COMMAND = "python -m app.ship_previews"


def build(model_id: str = "smollm2-135m", out_root: Path = figure_preview.SHIPPED_ROOT,
          wait_s: float = 180.0) -> dict[str, Any]:
    """Make the previews of every method page's first figure on `model_id` and write them under `out_root`;
    returns the manifest."""
    from playwright.sync_api import sync_playwright

    from app import bench
    from probes.paths import user_cache_dir

    browser_path = bench._browser_path()
    if browser_path is None:
        raise SystemExit("needs Chromium and playwright (`make chromium`)")
    pages = bench.FIRST_RESULT_PAGES
    with tempfile.TemporaryDirectory() as cache, sync_playwright() as pw:
        made = Path(cache) / figure_preview.folder().relative_to(user_cache_dir())  # where the app writes them
        env = {"THOUGHTSCOPE_CACHE_DIR": cache, figure_preview.SHIPPED_SWITCH: "0", figure_preview.SWITCH: "1"}
        browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        with bench._app(model_id, env) as url:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            home = context.new_page()
            home.set_default_timeout(900_000)
            home.goto(url)
            home.locator(bench.METRIC).first.wait_for()
            home.close()
            for name in pages:
                print(f"opening {name}", file=sys.stderr, flush=True)
                bench.page_first_result_times(context, url, name)
            deadline = time.time() + wait_s
            while len(list(made.glob("*.png"))) < len(pages) and time.time() < deadline:
                time.sleep(1.0)
            context.close()
        browser.close()
        files = sorted(made.glob("*.png"))
        if len(files) < len(pages):
            raise SystemExit(f"only {len(files)} previews were made for {len(pages)} pages in {wait_s:.0f} s")
        out = out_root / figure_preview.subfolder()
        if out_root.exists():
            shutil.rmtree(out_root)  # previews of another plotly version are dead weight in the repository
        out.mkdir(parents=True)
        for f in files:
            shutil.copyfile(f, out / f.name)
    import plotly

    manifest = {"what": "static previews of each method page's first figure (app/figure_preview.py)",
                "model": model_id, "pages": list(pages), "plotly": plotly.__version__,
                "size": {"width_px": figure_preview.WIDTH, "scale": figure_preview.SCALE},
                "files": {f.name: hashlib.sha256((out / f.name).read_bytes()).hexdigest() for f in files},
                "command": f"{COMMAND} --model {model_id}",
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args(argv)
    manifest = build(args.model)
    print(json.dumps({k: manifest[k] for k in ("model", "plotly", "created")} | {"files": len(manifest["files"])}))


if __name__ == "__main__":
    main()

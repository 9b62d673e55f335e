"""Drawing a region on the image in a real browser (issue 27, item 3): on the visual attribution page of a
tiny Qwen2-VL, a box dragged over the image becomes a line of the boxes and a region of the heat maps.
Its own app start (a VLM), so slow as well as browser."""

from __future__ import annotations

import pytest

from tests.test_browser import SLOW, serve

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_a_box_dragged_on_the_image_joins_the_regions(browser):
    with serve("tiny-random:qwen2_vl") as url:
        context = browser.new_context(viewport={"width": 1400, "height": 1400})
        p = context.new_page()
        p.set_default_timeout(SLOW)
        p.goto(f"{url}/visual_attribution")
        p.get_by_text("boxes", exact=True).click()
        chart = p.locator(".js-plotly-plot", has_text="drag a box on the image")
        chart.wait_for()
        area = chart.locator(".nsewdrag").first.bounding_box()
        x, y, w, h = area["x"], area["y"], area["width"], area["height"]
        p.mouse.move(x + 0.05 * w, y + 0.05 * h)
        p.mouse.down()
        p.mouse.move(x + 0.3 * w, y + 0.3 * h, steps=8)
        p.mouse.move(x + 0.45 * w, y + 0.45 * h, steps=8)
        p.mouse.up()
        boxes = p.wait_for_function("() => [...document.querySelectorAll('textarea')].map(t => t.value)"
                                    ".find(v => v.includes('drawn 2'))").json_value()
        line = next(ln for ln in boxes.splitlines() if ln.startswith("drawn 2"))
        x0, y0, x1, y1 = (int(v) for v in line.split()[2:])
        # the 64-pixel image fills the plot: 5% .. 45% of its side, within a pixel or two of plotly's rounding
        assert abs(x0 - 3) <= 2 and abs(y0 - 3) <= 2 and abs(x1 - 29) <= 2 and abs(y1 - 29) <= 2
        p.get_by_text("3 regions:", exact=False).first.wait_for()  # the caption lists the new region
        assert "drawn 2 (" in p.get_by_text("3 regions:", exact=False).first.inner_text()
        context.close()

"""The steering page in a real browser (split from tests/test_browser.py so that `make test`'s browser
workers share the long files evenly): the slider, the sweep, and a stack from two sources with its
sliders and preset. The session's app on tiny-random:llama and its Chromium (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from tests.test_browser import ARTIFACTS, SLOW, app_url, download, page  # noqa: F401  (fixtures)

pytestmark = pytest.mark.browser


def test_moving_the_steering_slider_changes_the_steered_text(page, app_url):
    page.goto(f"{app_url}/steering")
    steered = page.locator(".st-key-steered-text [data-testid='stText']")
    steered.wait_for()
    before = steered.inner_text()
    unsteered = page.locator(".st-key-unsteered-text [data-testid='stText']").inner_text()
    assert "mean" in page.locator(".st-key-steer_scale").inner_text()  # the unit is on the slider
    page.screenshot(path=str(ARTIFACTS / "steering_before.png"), full_page=True)

    page.locator(".st-key-steer_scale input[type='range']").focus()
    from app.views.steering import GRID

    page.keyboard.press("Home")  # the slider's first stop, GRID[0] x the mean activation norm
    page.wait_for_function(
        "([sel, old]) => { const e = document.querySelector(sel); return e && e.innerText !== old; }",
        arg=[".st-key-steered-text [data-testid='stText']", before], timeout=SLOW)
    page.locator(".st-key-steered-text").filter(has_text=f"scale {GRID[0]:g}").wait_for()
    assert steered.inner_text() != before and steered.inner_text().strip()  # never an empty box
    assert page.locator(".st-key-unsteered-text [data-testid='stText']").inner_text() == unsteered
    page.screenshot(path=str(ARTIFACTS / "steering_after.png"), full_page=True)


def test_a_steering_sweep_renders_side_by_side(page, app_url):
    page.goto(f"{app_url}/steering")
    page.locator(".st-key-steered-text [data-testid='stText']").wait_for()
    page.locator(".st-key-steer_sweep_run button").click()
    page.locator('[data-testid="stPlotlyChart"]').filter(has_text="Steering sweep").locator(".main-svg").first.wait_for()
    boxes = page.locator("[class*='st-key-sweep-text'] [data-testid='stText']")
    from app.views.steering import SWEEP_DEFAULT

    assert boxes.count() == len(SWEEP_DEFAULT) and all(t.strip() for t in boxes.all_inner_texts())
    page.screenshot(path=str(ARTIFACTS / "steering_sweep.png"), full_page=True)


IDLE_JS = """() => !document.querySelector('[class*="st-key-job-"]') &&
                 !document.querySelector('[data-testid="stStatusWidget"]')"""


def settled(page, timeout: int = 4 * SLOW) -> None:
    """The page has drawn: no job shows its progress and no script runs, twice half a second apart, so a click
    acts on the page as drawn. (This test's failures under load came from the page itself: a figure drawn while
    the warm-up thread imported pandas; `thoughtscope.imports.settle`, tests/test_warm.py.)"""
    for _ in range(2):
        page.wait_for_timeout(500)
        page.wait_for_function(IDLE_JS, timeout=timeout)


def test_a_steering_stack_from_two_sources_answers_its_sliders(page, app_url, tmp_path):
    """The page's difference-of-means direction and an uploaded vector go into the stack; moving the first
    term's slider changes the stack's text and the strip of what each term added per token."""
    import torch
    from safetensors.torch import save_file

    vector = torch.randn(64, generator=torch.Generator().manual_seed(3))
    save_file({"vector": vector}, str(tmp_path / "v.safetensors"))
    page.goto(f"{app_url}/steering")
    page.locator(".st-key-steered-text [data-testid='stText']").wait_for()
    settled(page)
    page.locator(".st-key-steer_add_to_stack button").first.click()
    page.locator(".st-key-stack_strength_0").wait_for()
    page.locator(".st-key-steer_source").get_by_text("a .safetensors vector").click()
    page.locator(".st-key-steer_upload input[type='file']").set_input_files(str(tmp_path / "v.safetensors"))
    # the page has read the upload: its caption gives the uploaded vector's norm (the steered text of the previous
    # direction stays on the page while it reruns)
    page.get_by_text(f"|v| = {float(vector.norm()):.3g};").wait_for(timeout=SLOW)
    settled(page)
    page.locator(".st-key-steer_add_to_stack button").first.click()
    page.locator(".st-key-stack_strength_1").wait_for()
    strip = page.locator(".st-key-stack-strip [data-testid='stText']")
    page.wait_for_function("(sel) => { const e = document.querySelector(sel); return e && e.innerText.includes('2. '); }",
                           arg=".st-key-stack-strip [data-testid='stText']", timeout=SLOW)
    text = page.locator(".st-key-stack-steered-text [data-testid='stText']")
    before, strip_before = text.inner_text(), strip.inner_text()
    assert "1. difference of means: acted at" in strip_before and "2. v.safetensors: acted at" in strip_before
    page.screenshot(path=str(ARTIFACTS / "steering_stack_before.png"), full_page=True)
    page.locator(".st-key-stack_strength_0 input[type='range']").focus()
    page.keyboard.press("Home")  # the first term to the slider's first stop
    page.wait_for_function(
        "([sel, old]) => { const e = document.querySelector(sel); return e && e.innerText !== old; }",
        arg=[".st-key-stack-strip [data-testid='stText']", strip_before], timeout=SLOW)
    page.wait_for_function(
        "([sel, old]) => { const e = document.querySelector(sel); return e && e.innerText !== old; }",
        arg=[".st-key-stack-steered-text [data-testid='stText']", before], timeout=SLOW)
    assert text.inner_text().strip() and strip.inner_text() != strip_before
    page.screenshot(path=str(ARTIFACTS / "steering_stack_after.png"), full_page=True)
    # the stack saves as a preset and reopens from it (a removed term comes back with its moved strength)
    from app.views.steering import GRID

    page.wait_for_timeout(500)  # the rerun that drew the moved slider's text may still be finishing
    page.locator('[data-testid="stStatusWidget"]').wait_for(state="detached", timeout=4 * SLOW)
    preset = json.loads(download(page, "stack_save"))
    assert [t["strength"] for t in preset["terms"]][0] == GRID[0] and len(preset["terms"]) == 2
    (tmp_path / "stack.json").write_text(json.dumps(preset))
    page.locator(".st-key-stack_remove_0 button").click()
    page.locator(".st-key-stack_strength_0").wait_for(state="detached")
    page.locator(".st-key-stack_preset input[type='file']").set_input_files(str(tmp_path / "stack.json"))
    page.locator(".st-key-stack_strength_3").wait_for()  # the preset's two terms get new sliders (ids 2, 3)
    page.locator(".st-key-stack_strength_1").wait_for(state="detached")
    page.locator(".st-key-stack-strip").filter(has_text="1. difference of means").wait_for()
    assert page.locator(".st-key-stack_strength_2").inner_text().startswith("1. difference of means")

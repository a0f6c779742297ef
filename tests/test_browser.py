"""The HTML head view in a real browser: headless Chromium (Debian's /usr/bin/chromium) driven by
Playwright. Where the browser cannot be installed the test skips, with the reason; CI sets
ATTNKIT_REQUIRE_BROWSER=1, which turns the skip into a failure."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from attnkit.cli import main
from helpers.pages import page_data

pytestmark = pytest.mark.outer  # out of `make test-fast`

CHROMIUM = os.environ.get("ATTNKIT_CHROMIUM", "/usr/bin/chromium")
# The machine's closed network refuses Chromium's background connections: turn them off.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TEXT = "The <b>cat</b> sat </script><script>alert(1)</script> on the mat"


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    if not (shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    return None


@pytest.fixture(scope="module")
def browser():
    reason = _missing()
    if reason is not None:
        if os.environ.get("ATTNKIT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"ATTNKIT_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield launched
        launched.close()


def test_head_view_hover_switch_head_and_screenshot(browser, tmp_path):
    """The report `attnkit explain --model minilm --html` writes, for a text that tries to inject
    markup and a script."""
    path = tmp_path / "view.html"
    assert main(["explain", "--model", "minilm", "--text", TEXT, "--html", str(path)]) == 0
    data = page_data(path.read_text())
    weights, tokens = torch.tensor(data["weights"]), data["tokens"]
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.goto(path.as_uri())

    assert page.locator("#title").text_content() == f"all-MiniLM-L6-v2: {TEXT}"
    assert page.locator(".query").all_text_contents() == tokens  # shown as text, not markup
    assert page.locator("b").count() == 0

    def shown(layer: int, head: int, query: int) -> None:
        page.hover(f".query[data-i='{query}']")
        texts = page.locator(".key .weight").all_text_contents()
        assert all(re.fullmatch(r"\d\.\d{3}", text) for text in texts)
        values = torch.tensor([float(text) for text in texts])
        torch.testing.assert_close(values, weights[layer, head, query], atol=5.1e-4, rtol=0)
        assert page.locator(".query.active").get_attribute("data-i") == str(query)
        lines = page.locator("svg line")
        assert lines.count() == len(tokens)
        strength = [float(lines.nth(j).get_attribute("stroke-opacity")) for j in range(len(tokens))]
        torch.testing.assert_close(torch.tensor(strength), weights[layer, head, query])

    shown(5, 0, 2)  # opens on the last layer, head 0
    page.select_option("#head", "7")
    shown(5, 7, 2)
    page.select_option("#layer", "1")
    shown(1, 7, len(tokens) - 1)

    shot = tmp_path / "view.png"
    page.screenshot(path=str(shot))
    import matplotlib.image

    assert matplotlib.image.imread(shot).std() > 0.02  # not a blank page
    assert problems == []


def test_learn_page_slider_redraws_the_maps_and_the_scores(browser, tmp_path):
    """The page `attnkit learn --out` writes: moving the slider to another snapshot redraws each
    head's map and writes that snapshot's role scores."""
    out = tmp_path / "run"
    tiny = ["--steps", "8", "--layers", "2", "--heads", "2", "--dim", "16", "--context", "16"]
    assert main(["learn", "--task", "copy", *tiny, "--out", str(out)]) == 0
    data = page_data((out / "learn.html").read_text())
    last = len(data["snapshot_steps"]) - 1
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto((out / "learn.html").as_uri())

    def drawn(layer: int, head: int) -> str:
        return page.eval_on_selector(f"#map-{layer}-{head}", "c => c.toDataURL()")

    def shown_scores(layer: int, head: int) -> dict[str, float]:
        lines = page.locator(".head").nth(2 * (layer - 1) + head - 1).locator(".scores div")
        return {
            line.get_attribute("data-role"): float(line.text_content().split()[-1])
            for line in lines.all()
        }

    assert page.locator("canvas").count() == 4
    assert page.locator("#map-2-1").get_attribute("data-snapshot") == str(last)  # opens at the end
    at_end = {(layer, head): drawn(layer, head) for layer in (1, 2) for head in (1, 2)}
    page.eval_on_selector(
        "#snapshot", "s => { s.value = '0'; s.dispatchEvent(new Event('input')); }"
    )
    assert page.locator("#map-2-1").get_attribute("data-snapshot") == "0"
    assert "step 0 " in page.locator("#step").text_content()
    for (layer, head), before in at_end.items():
        assert drawn(layer, head) != before, (layer, head)  # the map was redrawn, differently
        scores = shown_scores(layer, head)
        for role, value in scores.items():
            assert value == pytest.approx(data["scores"][role][0][layer - 1][head - 1], abs=5.1e-3)
    assert problems == []


def test_learn_page_at_1400_px_one_row_per_layer_and_a_chart_with_axes(browser, tmp_path):
    """A layer's four heads of 16 tokens share one row in a 1400-px window (they wrapped onto two),
    and the loss chart has axes, a curve per part of the copy task's loss and a legend; its
    caption gives the loss at the end."""
    out = tmp_path / "run"
    tiny = ["--steps", "8", "--layers", "2", "--heads", "4", "--dim", "16", "--context", "16"]
    assert main(["learn", "--task", "copy", *tiny, "--out", str(out)]) == 0
    data = page_data((out / "learn.html").read_text())
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto((out / "learn.html").as_uri())

    rows = page.eval_on_selector_all(
        ".layer", "rows => rows.map(r => [...r.children].map(c => c.getBoundingClientRect().top))"
    )
    assert len(rows) == 2 and all(len(set(row)) == 1 and len(row) == 4 for row in rows), rows
    assert page.eval_on_selector("#map-1-1", "c => c.width") >= 16 * 18  # values in the cells
    curves = page.eval_on_selector_all(".curve", "cs => cs.map(c => c.dataset.curve)")
    assert curves == ["loss", "loss_repeated", "loss_others"]
    assert page.locator("line.axis").count() == 2
    assert "0" in page.locator(".tick-x").all_text_contents()
    assert len(page.locator(".tick-y").all_text_contents()) >= 2
    assert "on the copied tokens" in page.locator(".legend").all_text_contents()
    assert page.locator("circle.held-out").count() == len(data["snapshot_steps"])
    caption = page.locator("#caption").text_content()
    assert caption == data["caption"] and f"{data['loss'][-1]:.3f} at the end" in caption
    page.set_viewport_size({"width": 700, "height": 900})  # narrower: smaller cells, redrawn
    page.wait_for_function("document.getElementById('map-1-1').width < 16 * 18")
    assert problems == []

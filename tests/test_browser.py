"""The HTML head view in a real browser: headless Chromium (Debian's /usr/bin/chromium) driven by
Playwright. Where the browser cannot be installed the test skips, with the reason; CI sets
ATTNKIT_REQUIRE_BROWSER=1, which turns the skip into a failure."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from attnkit.views import head_view_html, write_html

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
TOKENS = ["[CLS]", "the", "<b>cat</b>", "</script><script>alert(1)</script>", "[SEP]"]


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
    weights = torch.softmax(3 * torch.randn(2, 3, 5, 5), dim=-1)
    path = write_html(head_view_html(TOKENS, weights, "a <test> & title"), tmp_path / "view.html")
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.goto(path.as_uri())

    assert page.locator("#title").text_content() == "a <test> & title"
    assert page.locator(".query").all_text_contents() == TOKENS  # shown as text, not markup
    assert page.locator("b").count() == 0

    def shown(layer: int, head: int, query: int) -> None:
        page.hover(f".query[data-i='{query}']")
        texts = page.locator(".key .weight").all_text_contents()
        assert all(re.fullmatch(r"\d\.\d{3}", text) for text in texts)
        shown_values = torch.tensor([float(text) for text in texts])
        torch.testing.assert_close(shown_values, weights[layer, head, query], atol=5.1e-4, rtol=0)
        assert page.locator(".query.active").get_attribute("data-i") == str(query)
        lines = page.locator("svg line")
        assert lines.count() == len(TOKENS)
        strengths = [
            float(lines.nth(j).get_attribute("stroke-opacity")) for j in range(len(TOKENS))
        ]
        torch.testing.assert_close(
            torch.tensor(strengths), weights[layer, head, query], atol=1e-4, rtol=0
        )

    shown(1, 0, 2)  # opens on the last layer, head 0
    page.select_option("#head", "2")
    shown(1, 2, 2)
    page.select_option("#layer", "0")
    shown(0, 2, 4)

    shot = tmp_path / "view.png"
    page.screenshot(path=str(shot))
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.std() > 0.02  # not a blank page
    assert problems == []

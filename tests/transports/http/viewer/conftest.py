"""The viewer tests' fixtures: the browser checked before any server starts, and a page in it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.helpers.viewer import ARTIFACTS, CHROMIUM, REQUIRED


@pytest.fixture(autouse=True)
def _browser_present() -> None:
    """Fail before any server starts when the browser is required and missing."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"SESSIONTAPE_REQUIRE_BROWSER is set but there is no browser at {CHROMIUM}")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError as exc:
        if REQUIRED:
            pytest.fail(f"SESSIONTAPE_REQUIRE_BROWSER is set but playwright is missing: {exc}")
        pytest.skip(f"playwright is not installed: {exc}")


@pytest.fixture
async def page(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        pg = await browser.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        try:
            yield pg
            assert not errors, errors
        except BaseException:
            ARTIFACTS.mkdir(exist_ok=True)
            await pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
            raise
        finally:
            await browser.close()

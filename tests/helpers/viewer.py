"""The viewer's browser: which Chromium, whether it is required, where failed pages' screenshots go."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("SESSIONTAPE_CHROMIUM", "/usr/bin/chromium")
#: set by .ci/run: a missing browser is then a failure, not a skip
REQUIRED = os.environ.get("SESSIONTAPE_REQUIRE_BROWSER", "") not in ("", "0")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

#: every viewer test module's ``pytestmark``: a browser test, skipped without a browser
MARKS = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not REQUIRED and not os.path.exists(CHROMIUM),
        reason=f"no {CHROMIUM} (apt-get install -y chromium; the CI script installs it)",
    ),
]


#: every visible element: nothing sticks out of the window or is cut off by its box, no text boxes overlap
LAYOUT_CHECK = """() => {
  const problems = [];
  const vw = document.documentElement.clientWidth;
  if (document.documentElement.scrollWidth > vw + 1)
    problems.push(`the page scrolls sideways: ${document.documentElement.scrollWidth} > ${vw}`);
  const name = (el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
    + (typeof el.className === "string" && el.className.trim() ? "." + el.className.trim().split(/\\s+/).join(".") : "");
  const visible = [...document.querySelectorAll("body *")].filter((el) => {
    const r = el.getBoundingClientRect();
    const cs = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && cs.visibility !== "hidden" && cs.display !== "none";
  });
  for (const el of visible) {
    const cs = getComputedStyle(el);
    if (!["INPUT", "SELECT"].includes(el.tagName) && cs.overflowX !== "visible" && el.scrollWidth > el.clientWidth + 1)
      problems.push(`cut off: ${name(el)} ${el.scrollWidth} > ${el.clientWidth}`);
    const r = el.getBoundingClientRect();
    if (r.right > vw + 1 || r.left < -1) problems.push(`outside the window: ${name(el)} [${r.left}, ${r.right}] of ${vw}`);
  }
  const own = (el) => [...el.childNodes].some((n) => n.nodeType === 3 && n.nodeValue.trim());
  const boxes = visible.filter((el) => !el.classList.contains("tok") && (own(el) || ["INPUT", "SELECT", "BUTTON", "IMG"].includes(el.tagName)));
  // Text inside a scrolled box that is scrolled out of sight overlaps nothing a reader sees.
  const shown = boxes.filter((el) => {
    const box = el.closest("#conversation");
    if (!box || el === box) return true;
    const r = el.getBoundingClientRect(), b = box.getBoundingClientRect();
    return r.bottom > b.top && r.top < b.bottom;
  });
  for (let i = 0; i < shown.length; i++) {
    for (let j = i + 1; j < shown.length; j++) {
      const a = shown[i], b = shown[j];
      if (a.contains(b) || b.contains(a)) continue;
      const p = a.getBoundingClientRect(), q = b.getBoundingClientRect();
      const w = Math.min(p.right, q.right) - Math.max(p.left, q.left);
      const h = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
      if (w > 1 && h > 1) problems.push(`overlap: ${name(a)} "${a.textContent.slice(0, 30)}" and ${name(b)} "${b.textContent.slice(0, 30)}"`);
    }
  }
  return problems;
}"""

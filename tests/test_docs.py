"""The documents describe the system as it is: no work history, and every link lands.

Work history (which session of work changed what, which issue asked for it)
lives in git; a document or a comment that cites it goes stale the day it is
written. "Session" is also this product's word for a user's session ("forks of
this session", "a second session"), so the patterns below name the work-history
forms only: ordinal work sessions from the third on, "what changed this
session", "the previous session", "sessions ago", "this session's runs", and
issue numbers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
CODE_DIRS = ("core", "engines", "transports", "sessiontape", "migrations", "bench", "tests")

_ORDINAL = (
    r"third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|sixteenth|\d+(?:st|nd|rd|th)"
)

#: work history wherever it appears: docs, comments, docstrings
HISTORY = re.compile(
    "|".join(
        (
            rf"\b(?:{_ORDINAL}) session\b",
            r"\bsessions? ago\b",
            r"\bwhat changed (?:in )?this session\b",
            r"\b(?:earlier|later|since|before) this session\b",
            r"\bthis session's (?:runs?|code|figures|work|changes)\b",
            r"\bissues? #?\d+\b",
        )
    ),
    re.IGNORECASE,
)

#: only in prose: in code "the last session" may well be a user's session
DOC_HISTORY = re.compile(
    r"\b(?:the )?(?:last|previous|later|earlier) session\b|\bsession \d+\b", re.IGNORECASE
)

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _hits(pattern: re.Pattern[str], path: Path) -> list[str]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = pattern.search(line)
        if m:
            out.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    return out


def test_the_patterns_tell_work_history_from_user_sessions() -> None:
    history = [
        "**2026-11-25, eighth session** (06:06 UTC)",
        "What changed this session:",
        "on the code of the fifth session",
        "the 12th session's figures",
        "as measured two sessions ago",
        "the runs of the previous session",
        "Hostile gRPC input (issue 14): bad bytes",
        "see Issue #31",
        "earlier this session the ratio was",
    ]
    product = [
        "forks of this session, in log order",
        "continue this session without resending history",
        "a second session on the same engine gets SessionBusy",
        "this session's events, then its parent's",
        "SQLite, 8 sessions | 0.610",
        "the first session of a replica",
        "server-issued ids; a session issued by the server",
    ]
    for text in history:
        assert HISTORY.search(text) or DOC_HISTORY.search(text), text
    for text in product:
        assert not HISTORY.search(text) and not DOC_HISTORY.search(text), text


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_cite_no_work_history(path: Path) -> None:
    hits = _hits(HISTORY, path) + _hits(DOC_HISTORY, path)
    assert not hits, "work history in a document (git keeps it; state the fact):\n" + "\n".join(
        hits
    )


def test_comments_cite_no_work_history() -> None:
    hits = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            hits += _hits(HISTORY, path)
    assert not hits, "work history in a comment or docstring:\n" + "\n".join(hits)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_the_slug_is_githubs() -> None:
    assert _slug("Token path (`bench/bench_generate.py`)") == "token-path-benchbench_generatepy"
    assert _slug('Global order (the "sequence gap" problem)') == (
        "global-order-the-sequence-gap-problem"
    )
    assert _slug("Attention: `--attention gqa|masked`") == "attention---attention-gqamasked"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_land(path: Path) -> None:
    """Every relative link names a file that exists, and an anchor into a document names one
    of its headings: a design explained once is linked, and a link that lands nowhere is not."""
    broken = []
    text = path.read_text(encoding="utf-8")
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = path if not file else (path.parent / file).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no such heading in {dest.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)

"""The documents describe the system as it is: no work history, and every link lands.

Work history (which session of work changed what, which issue asked for it)
lives in git; a document or a comment that cites it goes stale the day it is
written. "Session" is also this product's word for a user's session ("forks of
this session", "a second session"), so the patterns below name the work-history
forms only: ordinal work sessions from the third on, "what changed this
session", "the previous session", "sessions ago", "this session's runs", and
issue numbers.

Nor a day's measurement: times of day, commit hashes and dated run logs are refused in
the documents (outside code) and in the source's comments and docstrings; figures go in
docs/performance.md's tables, dated, and that file stays short enough to read. The
README's layout names folders that exist.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
CODE_DIRS = ("core", "engines", "transports", "sessiontape", "migrations", "bench", "tests")
#: the source whose comments must not record a day's measurement (tests quote such text)
DIARY_CODE_DIRS = ("core", "engines", "transports", "sessiontape", "migrations", "bench", "scripts")

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


# -- a day's measurement: times of day, commit hashes, dated run logs ------------------------

#: a time of day: 11:09, 11:09 UTC, 10:34-10:50, 11:09:30
TIME_OF_DAY = re.compile(
    r"(?<![\w:.+])(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?:\s*[-\u2013]\s*(?:[01]?\d|2[0-3]):[0-5]\d)?"
    r"(?:\s*UTC)?(?![\w:])"
)

#: a commit hash: a short lowercase hex token with digits and letters (not a colour, not 0x..,
#: not part of an id or a UUID), a full 40-digit one, or any hex run that a 'commit' precedes
COMMIT_HASH = re.compile(
    r"(?<![\w#\-/.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w\-/.]|\.\w)"
    r"|(?<![\w#\-/.])[0-9a-f]{40}(?![\w\-/])"
    r"|\bcommit\s+[0-9a-f]{7,40}\b",
    re.IGNORECASE,
)

_DATE = r"\d{4}-\d{2}-\d{2}"

#: a dated run log, or a log of what was tried
RUN_LOG = re.compile(
    "|".join(
        (
            rf"\b(?:on|measured|ran|run|runs)\s+(?:on\s+)?{_DATE}\s*,?\s*(?:at|from|in the|between)\b",
            rf"\bmeasured (?:on|at) {_DATE}",
            rf"\b(?:until|since|before|after) {_DATE}",
            rf"\b{_DATE}\s*,?\s*(?:at|from)\s+\d",
            r"\b(?:measured|tried) and not adopted\b",
            r"\bnot adopted\b",
            r"\bday by day\b",
        )
    ),
    re.IGNORECASE,
)

DIARY = (TIME_OF_DAY, COMMIT_HASH, RUN_LOG)


def _prose(path: Path) -> list[tuple[int, str]]:
    """A document's lines outside fenced code, inline code blanked out."""
    out = []
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def _comments(path: Path) -> list[tuple[int, str]]:
    """A module's comments and docstrings, line by line (code and other strings left out)."""
    source = path.read_text(encoding="utf-8")
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                doc = body[0].value
                if isinstance(doc.value, str):
                    for i, line in enumerate(doc.value.splitlines()):
                        out.append((doc.lineno + i, line))
    return out


def _diary(lines: list[tuple[int, str]], where: str) -> list[str]:
    hits = []
    for n, line in lines:
        for pattern in DIARY:
            m = pattern.search(line)
            if m:
                hits.append(f"{where}:{n}: {m.group(0)!r}")
    return hits


def test_the_diary_patterns_catch_a_days_measurement() -> None:
    diary = [
        "the 11:14 run gave 567 turns/s",
        "2026-11-28 11:14-11:18 UTC, the engine alone at 0.42 ms",
        "between 10:34-10:50 the VM was slow",
        "since 2026-11-28, 11:00 UTC the server",
        "measured against fdc6798 in alternating pairs",
        "the code before (commit b3f5df4) against",
        "On 2026-11-28 from the fleet's runs",
        "measured on 2026-11-25 at a quiet hour",
        "## Measured and not adopted",
        "## The targets day by day",
        "rerun at 9:05",
    ]
    reference = [
        "| Kakeya turn, median | 2.4 ms | 2026-11-28 |",
        "colour #1a2b3c4d and 0xdeadbeef1 are not commits",
        "a session id s_1f3a9c0b2e and a UUID 0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d",
        "127.0.0.1:50051 and localhost:8080",
        "a ratio of 1:2 at 16:9",
        "a sha256 of " + "ab12" * 16,
        "the cache holds 4096 slots",
        "the `defaced` and `facade` words, and 2048-token prompts",
    ]
    for text in diary:
        assert any(p.search(text) for p in DIARY), text
    for text in reference:
        assert not any(p.search(text) for p in DIARY), (text, [p.search(text) for p in DIARY])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_record_no_days_measurement(path: Path) -> None:
    hits = _diary(_prose(path), str(path.relative_to(ROOT)))
    assert not hits, (
        "a time of day, a commit hash or a run log in a document (git keeps the runs; "
        "give the current figure and its date in the figures' table):\n" + "\n".join(hits)
    )


def test_comments_record_no_days_measurement() -> None:
    hits = []
    for folder in DIARY_CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "gen" in path.relative_to(ROOT).parts:
                continue
            hits += _diary(_comments(path), str(path.relative_to(ROOT)))
    assert not hits, (
        "a time of day, a commit hash or a run log in a comment or docstring (say what the "
        "code does and why):\n" + "\n".join(hits)
    )


def test_performance_is_a_reference_of_bounded_length() -> None:
    lines = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"docs/performance.md has {len(lines)} lines (at most 300)"


def _layout_dirs(readme: str) -> list[str]:
    """The folders the README's layout block names: each line's first, and the ones inside it,
    relative to that folder (or to the folder a parenthesis follows: ``http/ (native/)``),
    unless spelled from the root; an indented line goes on the line above."""
    section = readme.split("## Layout", 1)[1]
    block = section.split("```", 2)[1]
    named: list[str] = []
    stack: list[str] = []
    last = ""
    for line in block.splitlines()[1:]:
        m = re.match(r"([\w.-]+)/\s", line + " ")
        if m:
            stack, last = [m.group(1)], ""
            named.append(m.group(1))
            rest = line[m.end() :]
        elif stack and line.startswith(" "):
            rest = line
        else:
            continue
        for tok in re.findall(r"(?<![\w./])[\w-]+(?:/[\w-]+)*/(?!\w)|[(),]", rest):
            if tok == "(":
                stack.append(last or stack[-1])
            elif tok == ")":
                stack, last = stack[:-1] or stack, ""
            elif tok == ",":
                last = ""
            else:
                sub = tok.rstrip("/")
                last = sub if sub.split("/")[0] == stack[0] else f"{stack[-1]}/{sub}"
                named.append(last)
    return named


def test_the_layout_check_can_fail() -> None:
    sample = (
        "## Layout\n\n```\ncore/   the core\ntransports/  grpc/ (gRPC), sse/ (HTTP,\n"
        "             viewer/)\ntests/  helpers in tests/helpers/\n```\n"
    )
    assert _layout_dirs(sample) == [
        "core",
        "transports",
        "transports/grpc",
        "transports/sse",
        "transports/sse/viewer",
        "tests",
        "tests/helpers",
    ]


def test_the_readme_layout_names_folders_that_exist() -> None:
    named = _layout_dirs((ROOT / "README.md").read_text(encoding="utf-8"))
    assert named, "README.md has no layout block"
    missing = [d for d in named if not (ROOT / d).is_dir()]
    assert not missing, f"README.md's layout names folders that do not exist: {missing}"

"""Incremental detokenization: the text of a token run that only grows at its end."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[Sequence[int]], str]

REPLACEMENT = "\ufffd"


class TextRun:
    """The text of a token run that only grows at its end, without re-decoding the run.

    Each :meth:`push` decodes a window of recent tokens (at most about
    ``LIMIT`` plus what is pushed) and returns what the new tokens add to
    the text. The text only ever grows: a trailing character that does not
    decode yet (U+FFFD, e.g. the first byte of a multi-byte UTF-8 character)
    is held back until a later token completes it (or shows it was not the
    start of a character) or :meth:`flush` ends the run. ``CONTEXT`` tokens stay
    in front of the new ones because tokenizers render a token differently
    at the start of a text (SentencePiece drops a word's leading space).

    The window is cut only where the tokens after the cut decode on their
    own to the end of the window's text, so for byte-level (UTF-8)
    tokenizers the text is exactly ``detokenize(run)`` less a held-back
    trailing character (tested as a property on random bytes), before and
    after :meth:`flush`.
    """

    CONTEXT = 8
    LIMIT = 32

    def __init__(self, detokenize: Detokenize) -> None:
        self._detok = detokenize
        self._window: list[int] = []
        #: characters of ``detokenize(window)`` that are already in the text
        self._done = 0

    def start(self, ids: Sequence[int]) -> str:
        """Restart the run as ``ids`` (one full decode); returns its text."""
        self._window, self._done = [], 0
        return self.push(ids)

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens at the end; returns the text they add (possibly "")."""
        w = self._window
        w.extend(ids)
        t = self._detok(w)
        end = len(t) - 1 if t.endswith(REPLACEMENT) else len(t)
        piece = t[self._done : end] if end > self._done else ""
        self._done = max(self._done, end)
        if len(w) > self.LIMIT:
            self._trim(t)
        return piece

    def flush(self) -> str:
        """The held-back text, if any: the run is complete. A character the run ends
        in the middle of (a generation cut off by its token limit) is never text: its
        U+FFFD stays held back (the bytes stay in the log, the text ends before them)."""
        t = self._detok(self._window)
        end = len(t) - 1 if t.endswith(REPLACEMENT) else len(t)
        piece = t[self._done : end] if end > self._done else ""
        self._done = max(self._done, end)
        return piece

    def _trim(self, t: str) -> None:
        w = self._window
        top = len(w) - self.CONTEXT
        for k in range(top, max(0, top - self.LIMIT), -1):
            tail = self._detok(w[k:])
            cut = len(t) - len(tail)
            if cut <= self._done and t.endswith(tail):
                self._window = w[k:]
                self._done -= cut
                return
        if top > 3 * self.LIMIT:
            # No clean cut near the end (not a byte-level tokenizer?): bound the window anyway.
            k = top - self.LIMIT
            tail = self._detok(w[k:])
            self._window = w[k:]
            self._done = max(0, self._done - (len(t) - len(tail)))


class StopCut:
    """Text that grows at its end, cut before the first stop string: :meth:`feed` takes
    what was added and returns what may be shown; text that may begin a stop string
    is held back until it cannot (or ``final``). ``stopped`` is set once a stop string
    appeared; nothing after it is ever released. Only the held-back text is kept, so a
    piece costs the same however long the text already is."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""  # decoded text not yet released
        self.stopped = False

    def feed(self, piece: str, final: bool = False) -> str:
        """The text ``piece`` (and, with ``final``, the end of the text) releases."""
        if self.stopped:
            return ""
        text = self._held + piece
        end = len(text)
        for s in self._stops:
            i = text.find(s)
            if i != -1 and i < end:
                end = i
                self.stopped = True
        if not self.stopped and not final:
            for s in self._stops:  # hold back a suffix that may begin a stop string
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text.endswith(s[:k]):
                        end = min(end, len(text) - k)
                        break
        self._held = "" if self.stopped else text[end:]
        return text[:end]


class TextStream:
    """Generated tokens to text deltas: multi-byte characters split across tokens
    are held back until complete, and text that may start a stop string is held
    back until it cannot (:class:`StopCut`). ``stopped`` is set once a stop string
    appeared; the text ends before it. A pure function of the tokens, so a stream
    replayed from the log gives the same deltas as the live one."""

    def __init__(self, detokenize: Detokenize, stops: Sequence[str] = ()) -> None:
        # the session document's incremental decoder: a short window with context in
        # front, so tokenizers that render a token differently at the start of a text
        # (SentencePiece's leading space) decode as they would in the whole run
        self._run = TextRun(detokenize)
        self._cut = StopCut(stops)
        self._parts: list[str] = []  # the released text

    @property
    def stopped(self) -> bool:
        return self._cut.stopped

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        return self._release(self._run.push([token]), final=False)

    def extend(self, tokens: Sequence[int]) -> str:
        """:meth:`push` of several tokens at once (one decode); the text they release."""
        if self.stopped or not tokens:
            return ""
        return self._release(self._run.push(tokens), final=False)

    def finish(self) -> str:
        return self._release("" if self.stopped else self._run.flush(), final=True)

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def _release(self, piece: str, final: bool) -> str:
        delta = self._cut.feed(piece, final)
        if delta:
            self._parts.append(delta)
        return delta

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
    trailing character (tested as a property on random bytes).
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
        """The held-back text, if any: the run is complete."""
        t = self._detok(self._window)
        piece = t[self._done :]
        self._done = len(t)
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


class TextStream:
    """Generated tokens to text deltas: multi-byte characters split across tokens
    are held back until complete, and text that may start a stop string is held
    back until it cannot. ``stopped`` is set once a stop string appeared; the
    text ends before it. A pure function of the tokens, so a stream replayed
    from the log gives the same deltas as the live one."""

    def __init__(self, detokenize: Detokenize, stops: Sequence[str] = ()) -> None:
        # the session document's incremental decoder: a short window with context in
        # front, so tokenizers that render a token differently at the start of a text
        # (SentencePiece's leading space) decode as they would in the whole run
        self._run = TextRun(detokenize)
        self._stops = tuple(s for s in stops if s)
        self._text = ""  # decoded, stable text
        self._sent = 0  # characters of self._text already handed out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self._text += self._run.push([token])
        return self._release(final=False)

    def extend(self, tokens: Sequence[int]) -> str:
        """:meth:`push` of several tokens at once (one decode); the text they release."""
        if self.stopped or not tokens:
            return ""
        self._text += self._run.push(tokens)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self._text += self._run.flush()
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self._text)
        for s in self._stops:
            i = self._text.find(s, self._sent)
            if i != -1 and i < end:
                end = i
                self.stopped = True
        if self.stopped:
            self._text = self._text[:end]
        elif not final:
            for s in self._stops:  # hold back a suffix that may begin a stop string
                for k in range(min(len(s) - 1, end - self._sent), 0, -1):
                    if self._text.endswith(s[:k]):
                        end = min(end, len(self._text) - k)
                        break
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

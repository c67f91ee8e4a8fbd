"""Stop strings over a stream of text deltas.

OpenAI semantics: generation ends at the first occurrence of any stop string, and the stop
string itself is not returned. While streaming, text that might be the beginning of a stop
string is held back until the next delta shows whether it is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopMatcher:
    """Feed text deltas; get back the text that is safe to emit and whether a stop string hit."""

    stops: tuple[str, ...]
    held: str = ""
    stopped: bool = False
    _longest: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, delta: str) -> str:
        """Text to emit now for ``delta``; sets :attr:`stopped` when a stop string appears."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self.held + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.held = ""
            return text[:cut]
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: whatever was held back (it was not a stop string)."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

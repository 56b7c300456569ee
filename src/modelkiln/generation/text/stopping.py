"""Stop strings, matched in the generated text even when they span several tokens.

Text that might be the beginning of a stop string is held back until the next tokens show it is
not (so a client never receives "Obs" of a stop string "Observation:"). On a match, the text is
cut where the stop string begins and the stop string itself is not returned (OpenAI's rule)."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...] | list[str]):
        self.stop = tuple(stop)
        self._held = ""  # text received but not yet released
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add newly decoded text; return what is safe to emit now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self.stop:
            return text
        self._held += text
        cut = min((i for i in (self._held.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            released, self._held = self._held[:cut], ""
            return released
        keep = self._partial_match_length(self._held)
        released = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return released

    def flush(self) -> str:
        """At the end of generation nothing more can complete a stop string: release the rest."""
        released, self._held = ("" if self.stopped else self._held), ""
        return released

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

"""Stop sequences on the visible answer text (docs/PROTOCOLS.md, Stop sequences)."""

from __future__ import annotations

from ds4.chat.events import ParserEvent, TextDelta


class StopText:
    """Holds back answer text that may begin a stop sequence; reports the first complete one.

    Text that could still grow into a stop string is never streamed, so a client never sees
    a stop sequence or a piece of one. Reasoning and tool arguments are not scanned.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.emitted = ""  # answer text let through so far
        self.hit: str | None = None  # the stop string that ended the answer

    def filter(self, events: list[ParserEvent]) -> list[ParserEvent]:
        """Events as the client should see them; nothing passes after a hit."""
        out: list[ParserEvent] = []
        for event in events:
            if self.hit is not None:
                break
            if isinstance(event, TextDelta) and self.stops:
                out += self._text(event.text)
            else:
                out += self.flush()
                out.append(event)
        return out

    def flush(self) -> list[ParserEvent]:
        """Release held text: the answer ended or moved on without completing a stop string."""
        if not self.held or self.hit is not None:
            return []
        return self._let_through(self._take_held())

    def _text(self, text: str) -> list[ParserEvent]:
        buf = self.held + text
        self.held = ""
        match = self._first_match(buf)
        if match is not None:
            at, self.hit = match
            return self._let_through(buf[:at])
        keep = self._partial_tail(buf)
        self.held = buf[len(buf) - keep:]
        return self._let_through(buf[: len(buf) - keep])

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        found = [(buf.find(s), s) for s in self.stops if s in buf]
        return min(found) if found else None

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _take_held(self) -> str:
        text, self.held = self.held, ""
        return text

    def _let_through(self, text: str) -> list[ParserEvent]:
        if not text:
            return []
        self.emitted += text
        return [TextDelta(text)]

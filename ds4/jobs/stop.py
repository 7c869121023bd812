"""Stop sequences on the visible answer text (docs/PROTOCOLS.md, Stop sequences)."""

from __future__ import annotations

from ds4.chat.events import ParserEvent, TextDelta


class StopText:
    """Holds back answer text that may begin a stop sequence; cuts at the earliest one.

    Text that could still grow into a stop string is never streamed, so a client never sees
    a stop sequence or a piece of one. The answer ends before the stop string that starts
    earliest in the text, whatever the order of the list and however the text was split into
    pieces. Reasoning and tool arguments are not scanned.
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
                continue
            out += self.flush()  # may itself end the answer at a held stop string
            if self.hit is None:
                out.append(event)
        return out

    def flush(self) -> list[ParserEvent]:
        """Release held text at the end of the answer (or when it moves on to a tool call or
        reasoning): a stop string complete inside it still ends the answer there."""
        if not self.held or self.hit is not None:
            return []
        buf = self._take_held()
        match = self._first_match(buf)
        return self._let_through(buf) if match is None else self._stop_at(buf, match)

    def _text(self, text: str) -> list[ParserEvent]:
        buf = self.held + text
        self.held = ""
        match = self._first_match(buf)
        growing = len(buf) - self._partial_tail(buf)  # a stop string may still grow from here
        if match is not None and match[0] <= growing:
            return self._stop_at(buf, match)
        # a longer stop string that began before a complete one may still complete: wait
        self.held = buf[growing:]
        return self._let_through(buf[:growing])

    def _stop_at(self, buf: str, match: tuple[int, str]) -> list[ParserEvent]:
        at, self.hit = match
        return self._let_through(buf[:at])

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

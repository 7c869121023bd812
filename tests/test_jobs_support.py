"""Shared pieces of the jobs tests: event recording, a test clock, a scripted session double.

The scheduler tests run on the real tiny model; the scripted double here only serves tests of
per-token logic (stop strings, forced text, DSML recovery) that need exact token sequences a
random tiny model would never produce.
"""

from __future__ import annotations

import threading

import numpy as np

from ds4.jobs.events import Finished, Progress, Started, TokenEvents


class Recorder:
    """A JobSink that keeps every event (thread-safe)."""

    def __init__(self):
        self.events = []
        self._lock = threading.Lock()
        self.ended = threading.Event()

    def __call__(self, event):
        with self._lock:
            self.events.append(event)
        if not isinstance(event, (TokenEvents, Progress, Started)) and type(event).__name__ in (
                "Finished", "Failed"):
            self.ended.set()

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]

    def tokens(self):
        return [e.token_id for e in self.of(TokenEvents) if e.token_id != 1]

    def final(self):
        ends = [e for e in self.events if type(e).__name__ in ("Finished", "Failed")]
        assert len(ends) == 1, self.events
        return ends[0]

    def finished(self) -> Finished:
        end = self.final()
        assert isinstance(end, Finished), end
        return end


class StepClock:
    """A clock that advances `step` seconds each time it is read."""

    def __init__(self, step: float = 1.0):
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class ScriptedSession:
    """Session double: after n generated tokens its greedy choice is scripts[k][n], where k
    counts the syncs after the prompt's (a redecode syncs, so it follows the next script)."""

    def __init__(self, vocab: int, scripts: list[list[int]], ctx_size: int = 4096):
        self.vocab = vocab
        self.scripts = scripts
        self.syncs = 0
        self.ctx_size = ctx_size
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.logits = None
        self.decoded: list[int] = []

    def sync(self, ids, should_stop=None):
        self.tokens = list(ids)
        self.syncs += 1
        if not self.prompt_len:
            self.prompt_len = len(ids)
        self.logits = self._logits()
        return self.logits

    def reusable_prefix(self, ids):
        return 0

    def decode(self, tok):
        self.tokens.append(tok)
        self.decoded.append(tok)
        self.logits = self._logits()
        return self.logits

    def _logits(self):
        n = len(self.tokens) - self.prompt_len
        script = self.scripts[min(self.syncs, len(self.scripts)) - 1]
        out = np.zeros(self.vocab, dtype=np.float32)
        if n < len(script):
            out[script[n]] = 50.0
        else:
            out[1] = 50.0  # EOS once the script ran out
        return out


class ScriptedSlot:
    """Just what a Job reads of a slot."""

    def __init__(self, session):
        self.index = 0
        self.session = session
        self.call_ids = []

    def clear_bindings(self):
        self.call_ids = []

    def bind_call_ids(self, ids):
        self.call_ids = list(ids)


# -- temporary: stand-ins while the engine and the chat parser are being built -------------

class HashSession:
    """Session double: logits depend only on the token history (chunked sync, should_stop)."""

    def __init__(self, vocab, ctx_size, chunk):
        self.vocab, self.ctx_size, self.chunk = vocab, ctx_size, chunk
        self.tokens, self.logits, self.prompt_end = [], None, 0
        self.chunks = 0

    def reusable_prefix(self, ids):
        if self.tokens and self.tokens == list(ids[: len(self.tokens)]):
            return len(self.tokens)
        if self.prompt_end and self.tokens[: self.prompt_end] == list(ids[: self.prompt_end]):
            return self.prompt_end
        return 0

    def sync(self, ids, should_stop=None):
        if len(ids) > self.ctx_size:
            raise ContextOverflow("context")
        self.tokens = self.tokens[: self.reusable_prefix(ids)]
        while len(self.tokens) < len(ids):
            end = min(len(ids), (len(self.tokens) // self.chunk + 1) * self.chunk)
            self.tokens = list(ids[:end])
            self.chunks += 1
            if len(self.tokens) < len(ids) and should_stop and should_stop():
                self.logits = None
                return None
        self.prompt_end = len(ids)
        self.logits = self._logits()
        return self.logits

    def decode(self, tok):
        self.tokens.append(tok)
        self.logits = self._logits()
        return self.logits

    def _logits(self):
        rng = np.random.default_rng(hash(tuple(self.tokens)) & 0xFFFFFFFF)
        out = np.full(self.vocab, -30.0, dtype=np.float32)
        out[300:1300] = rng.standard_normal(1000).astype(np.float32)
        return out


class HashEngine:
    def __init__(self, chunk=16):
        from ds4.tokenizer import Tokenizer
        self.tokenizer = Tokenizer.for_model()
        self.chunk = chunk
        self.sessions = []

    def new_session(self, ctx_size=4096):
        s = HashSession(self.tokenizer.vocab_size, ctx_size, self.chunk)
        self.sessions.append(s)
        return s


class ContextOverflow(Exception):
    pass


def tiny_engine():
    return HashEngine(chunk=16)


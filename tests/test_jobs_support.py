"""Shared pieces of the jobs tests: event recording, a test clock, a scripted session double.

The scheduler tests run on the real tiny model; the scripted double here only serves tests of
per-token logic (stop strings, forced text, DSML recovery) that need exact token sequences a
random tiny model would never produce.
"""

from __future__ import annotations

import threading

import numpy as np

from ds4.jobs.events import Finished, Progress, Started, TokenEvents
from ds4.sampling import sample


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

    def token_events(self):
        return self.of(TokenEvents)

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

    def sample(self, opts, rng):
        return sample(self.logits, opts, rng)

    def _logits(self):
        n = len(self.tokens) - self.prompt_len
        script = self.scripts[min(self.syncs, len(self.scripts)) - 1]
        out = np.zeros(self.vocab, dtype=np.float32)
        if n < len(script):
            out[script[n]] = 50.0
        else:
            out[1] = 50.0  # EOS once the script ran out
        return out


class ScriptedEngine:
    """Engine double whose sessions follow token scripts (see ScriptedSession)."""

    def __init__(self, scripts: list[list[int]]):
        from ds4.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.for_model()
        self.scripts = scripts
        self.sessions: list[ScriptedSession] = []

    def new_session(self, ctx_size: int = 4096) -> ScriptedSession:
        session = ScriptedSession(self.tokenizer.vocab_size, self.scripts, ctx_size)
        self.sessions.append(session)
        return session


def tiny_engine(prefill_chunk: int = 16):
    """The built-in tiny model on NumPy; small chunks so prompts span several of them."""
    from ds4.engine import Engine, default_model_dir

    return Engine.open(default_model_dir(), backend="numpy", prefill_chunk=prefill_chunk)

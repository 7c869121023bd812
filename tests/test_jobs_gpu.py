"""Interleaving on the CuPy engine: sessions share its scratch and graphs, never each
other's state."""

from __future__ import annotations

import pytest
from test_jobs_support import Recorder

from ds4.backend import cuda_available
from ds4.jobs.events import JobRequest, SamplingOptions
from ds4.jobs.scheduler import Scheduler, SchedulerConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

TEXTS = ["The quick brown fox", "Once upon a time in a land far away, " * 3,
         "def main():\n    return 42"]


@pytest.fixture(scope="module")
def engine():
    from ds4.engine import Engine, default_model_dir

    return Engine.open(default_model_dir(), backend="cupy", prefill_chunk=16)


def run(engine, reqs, parallel):
    sched = Scheduler(engine, SchedulerConfig(parallel=parallel, ctx_size=512, decode_tokens=3))
    recs = [Recorder() for _ in reqs]
    for req, rec in zip(reqs, recs):
        sched.submit(req, rec)
    while sched.run_turn():
        pass
    assert not any(s["busy"] for s in sched.slots_info())
    return [rec.tokens() for rec in recs]


def test_interleaved_gpu_sessions_give_the_tokens_of_isolated_runs(engine):
    reqs = [JobRequest(prompt_tokens=engine.tokenizer.encode(t), max_tokens=24,
                       sampling=SamplingOptions(temperature=0.0)) for t in TEXTS]
    alone = [run(engine, [r], 1)[0] for r in reqs]
    assert run(engine, reqs, 3) == alone
    assert all(len(t) == 24 for t in alone)

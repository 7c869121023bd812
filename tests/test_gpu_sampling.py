"""Sampling on the device: CuPy logits give the same tokens as the host sampler for a seed
(needs CuPy and a GPU). Exact token equality is the claim; only the id leaves the device."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_sampling import TWIN_OPTIONS

from ds4.backend import cuda_available
from ds4.jobs.events import SamplingOptions
from ds4.sampling import make_rng, sample

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

OPTIONS = TWIN_OPTIONS  # the options the NumPy twin is checked with in CI


def rows() -> list[np.ndarray]:
    rng = np.random.default_rng(21)
    ties = np.round(rng.normal(size=3000) * 2).astype(np.float32)
    signed_zero = np.zeros(64, dtype=np.float32)
    signed_zero[::2] = -0.0  # -0.0 and 0.0 tie: the lower id must win on both sides
    return [(rng.normal(size=129280) * 3).astype(np.float32), np.zeros(5000, dtype=np.float32),
            ties, signed_zero]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_device_sampling_draws_the_host_tokens(options):
    import cupy

    for logits in rows():
        device_logits = cupy.asarray(logits)
        for seed in range(8):
            host, device = make_rng(seed), make_rng(seed)
            want = [sample(logits, options, host) for _ in range(4)]
            got = [sample(device_logits, options, device) for _ in range(4)]
            assert got == want, (seed, logits.size)
            assert type(got[0]) is int


def test_session_samples_its_device_logits():
    """A CuPy engine session samples the logits it holds on the device, token for token as the
    host sampler on its numpy copy; a seeded run repeats."""
    from ds4.engine import Engine, default_model_dir

    eng = Engine.open(default_model_dir(), backend="cupy")
    opts = SamplingOptions(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02)

    def run(seed: int) -> list[int]:
        s = eng.new_session(256)
        s.sync([0, 17, 99, 1234, 5])
        mine, theirs, out = make_rng(seed), make_rng(seed), []
        for _ in range(16):
            assert s._device_logits is not None  # the draw used the device copy
            out.append(s.sample(opts, mine))
            assert out[-1] == sample(s.logits, opts, theirs)
            s.decode(out[-1])
        return out

    assert run(5) == run(5)


def test_argmax_of_rows_in_one_launch_equals_each_rows_host_argmax():
    import cupy

    from ds4.kernels import sampling as kernels

    block = np.stack([r[:64] for r in rows()] + [np.full(64, -np.inf, np.float32)])
    out = cupy.full(len(block), -1, dtype=cupy.int32)
    kernels.argmax(cupy.asarray(block), out)
    assert out.get().tolist() == [int(np.argmax(r)) for r in block]


def test_argmax_takes_the_lowest_index_of_a_tie_on_vector_and_scalar_paths():
    """Vocabulary-sized rows (read four at a time), a ragged length and a row that starts off a
    16-byte boundary (read one at a time): ties at the maximum go to the lowest index."""
    import cupy

    from ds4.kernels import sampling as kernels

    rng = np.random.default_rng(3)
    block = rng.standard_normal((3, 129283)).astype(np.float32)
    block[0, [70001, 5, 129282]] = 9.0  # the tie: 5 wins
    block[1, [129282, 129281]] = 9.0  # in the scalar tail
    block[2, 3] = block[2, 4] = 9.0  # inside one group of four
    for n, offset in ((129280, 0), (129283, 0), (129000, 1)):
        dev = cupy.asarray(block)[:, offset:offset + n]
        out = cupy.full(3, -1, dtype=cupy.int32)
        kernels.argmax(dev, out)
        assert out.get().tolist() == [int(np.argmax(r)) for r in block[:, offset:offset + n]]


def test_a_steps_logit_rows_go_to_argmax_as_one_view_not_a_copy():
    import cupy

    from ds4.engine import _as_block

    logits = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    rows = [logits[b] for b in range(3)]
    assert _as_block(cupy, rows).data.ptr == logits.data.ptr
    assert cupy.array_equal(_as_block(cupy, rows), logits)
    scattered = [logits[2], logits[0]]
    assert cupy.array_equal(_as_block(cupy, scattered), cupy.stack(scattered))


def test_a_batched_steps_greedy_picks_and_lazy_logits_are_each_sessions_own():
    """After Engine.decode_batch on the GPU a session's logits stay on the device until read,
    and the argmax the step took for every row (one launch) is what greedy sampling of that
    session draws, and what the host argmax of its logits gives."""
    from ds4.engine import Engine, default_model_dir

    eng = Engine.open(default_model_dir(), backend="cupy")
    sessions = [eng.new_session(256) for _ in range(3)]
    for k, s in enumerate(sessions):
        s.sync([0, 17 + k, 99, 1234, 5 + 3 * k])
    greedy = SamplingOptions(temperature=0.0)
    for _ in range(6):
        picks = [s.sample(greedy, make_rng(0)) for s in sessions]
        rows = eng.decode_batch(sessions, picks)
        assert all(s._host_logits is None and s._greedy is not None for s in sessions)
        assert [s.sample(greedy, make_rng(0)) for s in sessions] == \
            [int(np.argmax(s.logits)) for s in sessions]
        assert all(np.array_equal(r, s.logits) for r, s in zip(rows, sessions))


def test_the_min_p_kernel_matches_its_twin():
    """sample_min_p (temperature, min_p and top_p in one launch) against its twin, over a whole
    row and over top_k's candidates of it: the drawn token, and -1 where every token passes
    (more than the kernel lists) or none does (a row of -inf)."""
    import cupy

    from ds4.kernels import sampling as kernels

    rng = np.random.default_rng(3)
    rows = [(rng.normal(size=129280) * 3).astype(np.float32), np.zeros(5000, np.float32),
            np.full(100, -np.inf, np.float32),
            np.round(rng.normal(size=3000) * 2).astype(np.float32)]
    for x, k in itertools.product(rows, (None, 40, 1000)):
        sel = None if k is None else kernels.topk_select_numpy(x, k, np.zeros(k, np.int32),
                                                                np.zeros(1, np.int32))
        for temperature, min_p in ((1.0, 0.05), (2.0, 0.2), (0.5, 0.01), (1.0, 1.5), (1.0, 0)):
            floor = float(np.float32(np.log(min(min_p, 1.0)))) if min_p else -np.inf
            for u, top_p in itertools.product((0.0, 0.3, 0.999999), (1.0, 0.9, 0.3)):
                got = kernels.sample_min_p(cupy.asarray(x), temperature, floor, u,
                                           cupy.zeros(1, cupy.int32), top_p,
                                           None if sel is None else cupy.asarray(sel))
                want = kernels.sample_min_p_numpy(x, temperature, floor, u, np.zeros(1, np.int32),
                                                  top_p, sel)
                assert int(got[0]) == int(want[0]), (x.size, k, temperature, min_p, u, top_p)
    assert int(want[0]) >= 0  # (the last row keeps a few tokens: a draw, not the fallback)


def test_random_option_mixes_draw_the_host_tokens():
    """200 random mixes of temperature, top_k, top_p and min_p over vocabulary-sized rows: the
    device's kernels (topk_select, sample_min_p) or masks draw the host's token."""
    import cupy

    rng = np.random.default_rng(21)
    for case in range(200):
        logits = (rng.normal(size=129280) * rng.choice([1.0, 3.0, 12.0])).astype(np.float32)
        if case % 4 == 0:
            logits = np.round(logits)
        options = SamplingOptions(temperature=float(rng.uniform(0.05, 4.0)),
                                  top_k=int(rng.choice([0, 0, 2, 40, 1000, 5000])),
                                  top_p=float(rng.choice([1.0, rng.uniform(0.01, 0.999)])),
                                  min_p=float(rng.choice([0.0, 1.5, rng.uniform(0.001, 0.6)])))
        want = sample(logits, options, make_rng(case))
        assert sample(cupy.asarray(logits), options, make_rng(case)) == want, (case, options)

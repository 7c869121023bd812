"""Sampling draws what the options allow, in known proportions, reproducibly for a seed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.jobs.events import SamplingOptions
from ds4.sampling import TOP_K_CAP, make_rng, sample, sample_masked


def logits_of(probs) -> np.ndarray:
    """Logits whose softmax is `probs`."""
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def device_twin(logits, options: SamplingOptions, rng) -> int:
    """The device path on NumPy: sample_masked's own code (its masks, its listing kernels'
    twins), which CuPy logits take."""
    return sample_masked(np, logits, options, rng)


# the filters' properties hold on both paths: a bound off by one in either is a test failure
PATHS = {"host": sample, "device": device_twin}


def draws(logits, n: int = 4000, seed: int = 7, path: str = "host", **opts) -> Counter:
    """Token counts of n draws with one seeded generator, on the host path or the device's."""
    options = SamplingOptions(**{"min_p": 0.0, **opts})
    rng, draw = make_rng(seed), PATHS[path]
    return Counter(draw(logits, options, rng) for _ in range(n))


def test_greedy_picks_the_largest_logit_and_the_lowest_id_on_ties() -> None:
    logits = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    rng = make_rng(0)
    assert sample(logits, SamplingOptions(temperature=0.0), rng) == 1
    assert sample(logits, SamplingOptions(temperature=-1.0), rng) == 1


@pytest.mark.parametrize("path", PATHS)
def test_top_k_one_is_greedy_even_when_hot(path) -> None:
    logits = np.random.default_rng(3).normal(size=1000).astype(np.float32)
    best = int(np.argmax(logits))
    assert set(draws(logits, path=path, n=200, temperature=5.0, top_k=1)) == {best}


@pytest.mark.parametrize("path", PATHS)
def test_frequencies_follow_the_softmax(path) -> None:
    counts = draws(logits_of([0.6, 0.3, 0.1]), path=path, n=20000, temperature=1.0)
    for token, p in enumerate([0.6, 0.3, 0.1]):
        assert abs(counts[token] / 20000 - p) < 0.02


@pytest.mark.parametrize("path", PATHS)
def test_temperature_flattens_the_distribution(path) -> None:
    # T = 2 turns p into p**0.5 / sum
    want = np.sqrt([0.6, 0.3, 0.1])
    want /= want.sum()
    counts = draws(logits_of([0.6, 0.3, 0.1]), path=path, n=20000, temperature=2.0)
    for token, p in enumerate(want):
        assert abs(counts[token] / 20000 - p) < 0.02


@pytest.mark.parametrize("path", PATHS)
def test_top_k_keeps_only_the_k_best(path) -> None:
    logits = logits_of([0.1, 0.4, 0.05, 0.3, 0.15])
    assert set(draws(logits, path=path, top_k=2)) == {1, 3}


@pytest.mark.parametrize("path", PATHS)
def test_top_k_is_capped(path) -> None:
    # a flat distribution over 3000 tokens: an uncapped top_k=3000 would reach every token
    logits = np.zeros(3000, dtype=np.float32)
    logits[:TOP_K_CAP] = 1e-3  # the capped set is the first TOP_K_CAP tokens
    seen = draws(logits, path=path, n=3000, top_k=3000)
    assert max(seen) < TOP_K_CAP
    assert len(seen) > TOP_K_CAP // 2


@pytest.mark.parametrize("path", PATHS)
def test_top_p_keeps_the_smallest_prefix_with_that_mass(path) -> None:
    logits = logits_of([0.05, 0.5, 0.15, 0.3])
    assert set(draws(logits, path=path, top_p=0.7)) == {1, 3}
    assert set(draws(logits, path=path, top_p=0.85)) == {1, 3, 2}
    assert set(draws(logits, path=path, top_p=0.4)) == {1}


@pytest.mark.parametrize("path", PATHS)
def test_top_p_reaches_beyond_the_first_thousand_candidates(path) -> None:
    logits = np.zeros(5000, dtype=np.float32)  # flat: 90% of the mass is 4500 tokens
    seen = draws(logits, path=path, n=3000, top_p=0.9)
    assert max(seen) >= 4000
    assert max(seen) < 4500


@pytest.mark.parametrize("path", PATHS)
def test_min_p_holds_when_more_tokens_pass_it_than_the_listing_kernel_keeps(path) -> None:
    # 3000 equal best tokens pass min_p 0.05 (past the device list's 2048: its masks decide);
    # the 3000 at e^-3.5 = 0.03 of them do not, though together they hold ~3% of the mass
    logits = np.zeros(6000, dtype=np.float32)
    logits[3000:] = -3.5
    seen = draws(logits, path=path, n=600, min_p=0.05)
    assert max(seen) < 3000 and len(seen) > 400
    assert max(draws(logits, path=path, n=600, min_p=0.0)) >= 3000  # what the filter removes


@pytest.mark.parametrize("path", PATHS)
def test_min_p_excludes_unlikely_tokens(path) -> None:
    logits = logits_of([0.5, 0.3, 0.12, 0.08])
    assert set(draws(logits, path=path, min_p=0.2)) == {0, 1, 2}  # 0.08 < 0.2 * 0.5
    assert set(draws(logits, path=path, min_p=0.5)) == {0, 1}


def test_a_seed_reproduces_the_same_tokens() -> None:
    logits = np.random.default_rng(5).normal(size=4096).astype(np.float32)
    options = SamplingOptions(temperature=1.0, top_p=0.95, min_p=0.01)

    def run(seed):
        rng = make_rng(seed)
        return [sample(logits, options, rng) for _ in range(50)]

    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_returns_a_python_int_in_range(dtype) -> None:
    logits = np.random.default_rng(1).normal(size=129280).astype(dtype)
    token = sample(logits, SamplingOptions(), make_rng(0))
    assert type(token) is int and 0 <= token < 129280


TWIN_OPTIONS = [SamplingOptions(), SamplingOptions(temperature=0.7, top_k=40, top_p=0.9, min_p=0.0),
                SamplingOptions(temperature=1.3, top_p=0.95, min_p=0.01),
                SamplingOptions(top_k=3000, min_p=0.0), SamplingOptions(top_p=0.5, min_p=0.0),
                SamplingOptions(temperature=2.0, min_p=0.2), SamplingOptions(temperature=0.0),
                SamplingOptions(top_k=1, temperature=3.0), SamplingOptions(min_p=1.5),
                SamplingOptions(temperature=2e-38, top_p=0.9, min_p=0.0),
                SamplingOptions(top_p=0.5), SamplingOptions(temperature=0.8, top_p=0.9, min_p=0.1)]


def twin_logits() -> list[np.ndarray]:
    """Wide random logits, a flat row, and many exact ties (integers), as the device sees them."""
    rng = np.random.default_rng(9)
    return [(rng.normal(size=129280) * 3).astype(np.float32), np.zeros(5000, dtype=np.float32),
            np.round(rng.normal(size=3000) * 2).astype(np.float32)]


@pytest.mark.parametrize("options", TWIN_OPTIONS, ids=str)
def test_device_path_twin_draws_the_host_tokens(options) -> None:
    # sample_masked is what runs on CuPy logits; with NumPy it must pick what the host picks
    for logits in twin_logits():
        for seed in range(6):
            host, device = make_rng(seed), make_rng(seed)
            want = [sample(logits, options, host) for _ in range(3)]
            assert [sample_masked(np, logits, options, device) for _ in range(3)] == want
            assert host.random() == device.random()  # both took the same number of draws


@pytest.mark.parametrize("options",
                         [SamplingOptions(min_p=1.5),
                          SamplingOptions(min_p=1.0, top_p=0.5)], ids=str)
def test_min_p_above_one_keeps_the_best_token(options) -> None:
    # no token can reach min_p > 1 times the best probability; the best one must still be drawn
    logits = np.array([1.0, 3.0, 2.0, -5.0], dtype=np.float32)
    assert sample(logits, options, make_rng(0)) == 1
    assert sample_masked(np, logits, options, make_rng(0)) == 1


@pytest.mark.parametrize("options",
                         [SamplingOptions(temperature=t, **knobs) for t in (2e-38, 1e-38, 1e-45)
                                     for knobs in ({"min_p": 0.0}, {"top_p": 0.9, "min_p": 0.0},
                                                   {"top_k": 2})],
                         ids=str)
def test_a_tiny_temperature_draws_the_best_token(options) -> None:
    # logits / T overflows float32 here (and 1e-38 is a subnormal float32 that a GPU may flush to
    # zero); the limit of T -> 0 is greedy, not an arbitrary token
    logits = np.array([10.0, 30.0, 20.0, -5.0], dtype=np.float32)
    for seed in range(4):
        assert sample(logits, options, make_rng(seed)) == 1
        assert sample_masked(np, logits, options, make_rng(seed)) == 1


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.5, float("nan")])
def test_top_p_outside_zero_to_one_keeps_every_token(top_p) -> None:
    # top_p outside (0, 1] reads as 1 (docs/PROTOCOLS.md, Sampling): the same draws as
    # top_p=1, on both paths
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert draws(logits, n=400, top_p=top_p) == draws(logits, n=400, top_p=1.0)
    assert set(draws(logits, n=400, top_p=top_p)) == {0, 1, 2, 3}
    host, device = make_rng(3), make_rng(3)
    options = SamplingOptions(top_p=top_p, min_p=0.0)
    want = [sample(logits, SamplingOptions(min_p=0.0), host) for _ in range(50)]
    assert [sample_masked(np, logits, options, device) for _ in range(50)] == want


@pytest.mark.parametrize("path", PATHS)
def test_top_p_of_one_and_just_below_differ(path) -> None:
    # 1.0 is inside the range and keeps everything; a hair below drops the 0.1% tail token
    logits = logits_of([0.6, 0.399, 0.001])
    assert 2 in draws(logits, path=path, n=8000, top_p=1.0)
    assert set(draws(logits, path=path, n=8000, top_p=0.995)) == {0, 1}


class FixedDraw:
    """A generator whose every uniform draw is `u` (selects a known survivor)."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def test_the_top_k_cap_is_exactly_1024_tokens() -> None:
    # the best 1100 tokens are flat; a draw at the top of [0, 1) picks the last survivor in
    # id order, which is the cap's last token
    logits = np.zeros(3000, dtype=np.float32)
    logits[:1100] = 1.0
    options = SamplingOptions(top_k=3000, min_p=0.0)
    assert sample(logits, options, FixedDraw(1 - 1e-12)) == TOP_K_CAP - 1 == 1023
    assert sample_masked(np, logits, options, FixedDraw(1 - 1e-12)) == 1023
    assert sample(logits, SamplingOptions(top_k=1100, min_p=0.0), FixedDraw(1 - 1e-12)) == 1023
    assert sample(logits, SamplingOptions(top_k=7, min_p=0.0), FixedDraw(1 - 1e-12)) == 6


@pytest.mark.parametrize("seed", range(6))
def test_ranking_is_descending_logit_then_ascending_id(seed: int) -> None:
    """top_p's ranking (one sort of packed keys) is the two-key order it stands for, with
    ties, -0.0 beside 0.0, -inf (overflowed by a tiny temperature) and NaN last."""
    from ds4.kernels.sampling import by_rank

    rng = np.random.default_rng(seed)
    n = 5000
    x = np.round(rng.standard_normal(n), 1).astype(np.float32)  # many ties
    x[rng.integers(0, n, 20)] = -np.inf
    x[rng.integers(0, n, 20)] = -0.0
    x[rng.integers(0, n, 3)] = np.nan
    ids = np.flatnonzero(rng.random(n) < 0.6)
    np.testing.assert_array_equal(by_rank(x, ids), ids[np.lexsort((ids, -x[ids]))])


def test_top_p_over_a_flat_vocabulary_keeps_the_best_ranked_prefix() -> None:
    """With the best 1024 of 129280 tokens holding too little mass, top_p ranks them all:
    the survivors are exactly the best tokens whose mass first reaches top_p."""
    from ds4.kernels.sampling import weights
    from ds4.sampling import _top_k_top_p

    x = np.random.default_rng(4).standard_normal(129280).astype(np.float32)
    scaled = x - x.max()
    kept = _top_k_top_p(scaled, scaled.size, 0.5, scaled.max())
    ranked = np.lexsort((np.arange(x.size), -scaled))
    w = weights(scaled[ranked], 0.0)
    cut = int(np.searchsorted(np.cumsum(w) / w.sum(), 0.5, side="left")) + 1
    assert kept.size > 1024
    np.testing.assert_array_equal(kept, ranked[:cut])


@pytest.mark.parametrize("seed", range(4))
def test_top_p_with_min_p_keeps_what_both_filters_keep(seed: int) -> None:
    """Over the whole vocabulary top_p then min_p rank only min_p's survivors: the kept set is
    the one the full ranking and the min_p filter give, on flat and peaked distributions."""
    from ds4.sampling import _log_min_p, _top_k_top_p, _top_p_within_min_p

    rng = np.random.default_rng(seed)
    for spread in (0.3, 1.0, 10.0):
        x = (rng.standard_normal(129280) * spread).astype(np.float32)
        if seed % 2:
            x = np.round(x, 1)  # ties at both filters' edges
        scaled = x - x.max()
        for top_p, min_p in ((0.9, 0.05), (0.5, 0.001), (0.99, 0.5)):
            floor = np.float32(0) + _log_min_p(SamplingOptions(min_p=min_p))
            want = _top_k_top_p(scaled, scaled.size, top_p, np.float32(0))
            want = np.sort(want[scaled[want] >= floor])
            got = np.sort(_top_p_within_min_p(scaled, top_p, np.float32(0), floor))
            np.testing.assert_array_equal(got, want)


@settings(max_examples=150, deadline=None)
@given(temperature=st.floats(0.05, 4.0), top_k=st.sampled_from([0, 2, 7, 40, 500, 5000]),
       top_p=st.sampled_from([1.0, 0.0, 1.5]) | st.floats(0.01, 0.999),
       min_p=st.sampled_from([0.0, 1.5]) | st.floats(0.001, 0.6),
       shape=st.sampled_from(["wide", "ties", "flat", "peaked"]), seed=st.integers(0, 2**16))
def test_any_options_draw_the_host_token_on_the_device_path(temperature, top_k, top_p, min_p,
                                                            shape, seed):
    # every mix of the filters (top_k's candidates, min_p's survivors, top_p's cut), through
    # the device path's listing kernel twin or its masks: the host's token for the same draw
    rng = np.random.default_rng(seed)
    logits = {"wide": rng.normal(size=3000) * 3, "ties": np.round(rng.normal(size=3000) * 2),
              "flat": np.zeros(2500), "peaked": rng.normal(size=3000) * 12}[shape]
    logits = logits.astype(np.float32)
    options = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert sample_masked(np, logits, options, make_rng(seed)) == \
        sample(logits, options, make_rng(seed))

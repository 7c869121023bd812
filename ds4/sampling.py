"""Draw the next token from logits: greedy, temperature, top_k, top_p, min_p, seeded.

Temperature scales the logits, top_k keeps the k best tokens, then top_p (smallest prefix of
the ranked tokens holding that probability mass) and min_p (probability at least min_p times
the best one's) both judge the distribution top_k left; a token must pass both. Candidates are
ranked by logit, then by lower token id, so a seed gives the same token on every machine.
"""

from __future__ import annotations

import numpy as np

from ds4.jobs.events import SamplingOptions

TOP_K_CAP = 1024  # larger top_k values are clamped to this
_PARTIAL = 1024  # top_p first looks at this many best tokens before sorting everything


def make_rng(seed: int | None) -> np.random.Generator:
    """A generator for one request: reproducible for a seed, fresh entropy for None."""
    return np.random.default_rng(seed)


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit; the lowest index wins a tie."""
    return int(np.argmax(logits))


def sample(logits, opts: SamplingOptions, rng: np.random.Generator) -> int:
    """One token id drawn from `logits` [vocab] under `opts`."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if opts.temperature <= 0 or opts.top_k == 1:
        return greedy(logits)
    scaled = logits / np.float32(opts.temperature)  # float32 exp is ~10x faster than float64
    pool = None  # None = every token, without materialising 129k ids
    if opts.top_k > 0:
        pool = _best(scaled, None, min(opts.top_k, TOP_K_CAP))
    values = scaled if pool is None else scaled[pool]
    peak = values.max()
    total = np.exp(values - peak).sum(dtype=np.float64)
    if opts.min_p > 0:  # p >= min_p * p_max, in log space
        keep = values >= peak + np.float32(np.log(opts.min_p))
        pool = np.flatnonzero(keep) if pool is None else pool[keep]
    elif pool is None:
        pool = np.arange(scaled.size)
    ids = _top_p(scaled, pool, opts.top_p, peak, total)
    cdf = np.cumsum(np.exp(scaled[ids] - peak), dtype=np.float64)
    pick = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(pick, ids.size - 1)])


def _by_rank(scaled: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`ids` ordered by descending logit, then ascending id."""
    return ids[np.lexsort((ids, -scaled[ids]))]


def _best(scaled: np.ndarray, ids: np.ndarray | None, n: int) -> np.ndarray:
    """The n best of `ids` (None = all tokens), ranked; a tie at the edge goes to the lower id."""
    values = scaled if ids is None else scaled[ids]
    if n >= values.size:
        return _by_rank(scaled, np.arange(values.size) if ids is None else ids)
    kth = np.partition(values, values.size - n)[values.size - n]
    near = np.flatnonzero(values >= kth)
    return _by_rank(scaled, near if ids is None else ids[near])[:n]


def _top_p(scaled: np.ndarray, pool: np.ndarray, top_p: float, peak: float, total: float) -> np.ndarray:
    """Smallest ranked prefix of `pool` whose mass (of the top_k distribution) reaches top_p."""
    if top_p >= 1.0:
        return pool
    ranked = _best(scaled, pool, _PARTIAL)
    cdf = np.cumsum(np.exp(scaled[ranked] - peak), dtype=np.float64) / total
    if cdf[-1] < top_p and ranked.size < pool.size:
        ranked = _by_rank(scaled, pool)  # the partial list does not hold enough mass
        cdf = np.cumsum(np.exp(scaled[ranked] - peak), dtype=np.float64) / total
    keep = int(np.searchsorted(cdf, top_p, side="left")) + 1
    return ranked[:keep]

"""Draw the next token from logits: greedy, temperature, top_k, top_p, min_p, seeded.

Temperature scales the logits, top_k keeps the k best tokens, then top_p (smallest prefix of
the ranked tokens holding that probability mass; a top_p outside (0, 1] filters nothing) and
min_p (probability at least min_p times the best one's) both judge the distribution top_k
left; a token must pass both. Candidates are ranked by logit, then by lower token id. The
survivors, in token-id order, split [0, 1) by their float64 weights and one uniform draw of
the request's generator picks the token.

Logits on the GPU (a CuPy array) are sampled there and only the token id comes back; the draw
still comes from the same host generator, so a seed gives the same tokens on both backends.
The host path works on a few candidates; the device path (`sample_masked`) on masks over the
whole vocabulary, or, with top_k or min_p, in a kernel that lists the survivors and ranks them;
both compute the same function (NumPy runs the device path as its twin).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4.kernels.sampling import by_rank, top_p_prefix, weights

TOP_K_CAP = 1024  # larger top_k values are clamped to this
# Below the smallest normal float32 a GPU kernel may flush T to zero (0/0 = NaN for the best
# token); the T -> 0 limit is greedy anyway.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
_PARTIAL = 1024  # top_p first looks at this many best tokens before sorting everything


@dataclass(frozen=True)
class SamplingOptions:
    """How tokens are drawn; temperature <= 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.05
    seed: int | None = None


def make_rng(seed: int | None) -> np.random.Generator:
    """A generator for one request: reproducible for a seed, fresh entropy for None."""
    return np.random.default_rng(seed)


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit; the lowest index wins a tie."""
    return int(np.argmax(logits))


def is_greedy(opts: SamplingOptions) -> bool:
    """True when the options leave one choice (no random draw is taken)."""
    return opts.temperature < MIN_TEMPERATURE or opts.top_k == 1


def sample(logits, opts: SamplingOptions, rng: np.random.Generator) -> int:
    """One token id drawn from `logits` [vocab] (NumPy, or CuPy: sampled on the device)."""
    if hasattr(logits, "__cuda_array_interface__"):
        import cupy

        return sample_masked(cupy, logits, opts, rng)
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if is_greedy(opts):
        return greedy(logits)
    return _pick(_scaled(logits, opts.temperature), opts, rng.random())


def _scaled(logits, temperature: float):
    """(logits - max) / T: the best token sits at 0, so a tiny T can only overflow the others
    to -inf (weight 0); logits / T would overflow the best ones to +inf and draw garbage."""
    with np.errstate(over="ignore"):  # the overflow to -inf is the intended limit
        return (logits - logits.max()) / logits.dtype.type(temperature)


def _top_p(opts: SamplingOptions) -> float:
    """top_p as the filter applies it: a value outside (0, 1] (NaN too) keeps every token."""
    return opts.top_p if 0.0 < opts.top_p <= 1.0 else 1.0


def _log_min_p(opts: SamplingOptions) -> np.float32:
    """log of min_p, capped at 1 so the best token always passes the filter."""
    return np.float32(np.log(min(opts.min_p, 1.0)))


def _pick(scaled: np.ndarray, opts: SamplingOptions, u: float) -> int:
    """Host path: the token that draw u selects among the survivors of the filters."""
    n, peak = scaled.size, scaled.max()
    k = min(opts.top_k, TOP_K_CAP) if opts.top_k > 0 else n
    top_p = _top_p(opts)
    floor = peak + _log_min_p(opts) if opts.min_p > 0 else None  # p >= min_p * p_max, as logs
    if floor is not None and k >= n and top_p < 1.0:  # (min_p applied inside)
        ids = _top_p_within_min_p(scaled, top_p, peak, floor)
    else:
        ids = _top_k_top_p(scaled, k, top_p, peak) if k < n or top_p < 1.0 else None
        if floor is not None:
            ids = np.flatnonzero(scaled >= floor) if ids is None else ids[scaled[ids] >= floor]
    ids = np.arange(n) if ids is None else np.sort(ids)
    cdf = np.cumsum(weights(scaled[ids], peak))
    pick = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(ids[min(pick, ids.size - 1)])


def _top_p_within_min_p(scaled: np.ndarray, top_p: float, peak, floor) -> np.ndarray:
    """top_p over the whole vocabulary, ranking only min_p's survivors: both filters keep a
    prefix of the ranked tokens, so together they keep the shorter one, and the cumulative
    mass over min_p's prefix is the very cdf a full ranking computes (the same sums in the
    same order). A flat distribution no longer ranks all of its 129280 tokens a draw."""
    return top_p_prefix(scaled, np.flatnonzero(scaled >= floor), top_p, peak)


def _best(scaled: np.ndarray, n: int) -> np.ndarray:
    """The n best tokens, ranked; a tie at the edge goes to the lower id."""
    if n >= scaled.size:
        return by_rank(scaled, np.arange(scaled.size))
    kth = np.partition(scaled, scaled.size - n)[scaled.size - n]
    return by_rank(scaled, np.flatnonzero(scaled >= kth))[:n]


def _top_k_top_p(scaled: np.ndarray, k: int, top_p: float, peak) -> np.ndarray:
    """Ranked ids of the k best that form the smallest prefix whose mass (of the top_k
    distribution) reaches top_p."""
    full = k >= scaled.size
    ranked = _best(scaled, min(k, _PARTIAL) if full and top_p < 1.0 else k)
    if top_p >= 1.0:
        return ranked
    total = weights(scaled, peak).sum() if full else weights(scaled[ranked], peak).sum()
    cdf = np.cumsum(weights(scaled[ranked], peak)) / total
    if cdf[-1] < top_p and ranked.size < k:
        ranked = _best(scaled, k)  # the partial list does not hold enough mass
        cdf = np.cumsum(weights(scaled[ranked], peak)) / total
    return ranked[: int(np.searchsorted(cdf, top_p, side="left")) + 1]


def sample_masked(xp, logits, opts: SamplingOptions, rng: np.random.Generator) -> int:
    """Device path on array module xp: masks over the vocabulary, one host sync for the id."""
    logits = xp.asarray(logits, dtype=xp.float32).reshape(-1)
    if is_greedy(opts):
        return _argmax(xp, logits)
    u = rng.random()
    n = logits.size
    k = min(opts.top_k, TOP_K_CAP) if opts.top_k > 0 else n
    top_p = _top_p(opts)
    if k < n or opts.min_p > 0:  # a short list of candidates: a kernel or two, no sort
        token = _listed_draw(xp, logits, opts, k, u)
        if token >= 0:
            return token
    scaled = _scaled(logits, opts.temperature)
    peak = scaled.max()
    weight = xp.exp(scaled.astype(xp.float64) - peak)
    keep = None
    if k < n or top_p < 1.0:
        order = _rank_order(xp, scaled)
        rank = xp.empty(n, dtype=xp.int64)
        rank[order] = xp.arange(n, dtype=xp.int64)
        limit = k
        if top_p < 1.0:
            mass = xp.cumsum(weight[order[:k]])
            target = xp.asarray([top_p], dtype=xp.float64)
            limit = xp.searchsorted(mass / mass[-1], target, side="left")[0] + 1
        keep = rank < limit
    if opts.min_p > 0:
        above = scaled >= peak + _log_min_p(opts)
        keep = above if keep is None else keep & above
    if keep is not None:
        weight = xp.where(keep, weight, 0.0)
    cdf = xp.cumsum(weight)
    pick = xp.searchsorted(cdf, (cdf[-1] * u).reshape(1), side="right")[0]
    last = n - 1 if keep is None else xp.where(keep, xp.arange(n), -1).max()
    return int(xp.minimum(pick, last))


def _listed_draw(xp, logits, opts: SamplingOptions, k: int, u: float) -> int:
    """The token of draw u by ds4/kernels/sampling.py's sample_min_p (its twin on NumPy) over
    min_p's survivors of the row, or of top_k's candidates (topk_select of the scaled logits,
    which the host ranks too); top_p cuts inside. A launch or two instead of a dozen and no sort
    of the vocabulary; -1 where it keeps none or too many tokens (then the masks decide)."""
    from ds4.kernels import sampling as kernels

    on_host = xp is np
    draw = kernels.sample_min_p_numpy if on_host else kernels.sample_min_p
    floor = float(_log_min_p(opts)) if opts.min_p > 0 else -np.inf
    out = xp.zeros(1, dtype=xp.int32)
    if k >= logits.size:
        draw(xp.ascontiguousarray(logits), opts.temperature, floor, u, out, _top_p(opts))
        return int(out[0])
    scaled = xp.ascontiguousarray(_scaled(logits, opts.temperature))
    sel, count = xp.zeros(k, dtype=xp.int32), xp.zeros(1, dtype=xp.int32)
    (kernels.topk_select_numpy if on_host else kernels.topk_select)(scaled, k, sel, count)
    draw(scaled, 1.0, floor, u, out, _top_p(opts), sel)  # (scaled: its max is 0, T is 1)
    return int(out[0])


def _rank_order(xp, scaled):
    """Token ids by descending logit, ties by ascending id (a stable sort of -logit; + 0 makes
    -0.0 equal to 0.0 for the radix sort on the device)."""
    key = -scaled + xp.float32(0)
    return np.argsort(key, kind="stable") if xp is np else xp.argsort(key)


def _argmax(xp, logits) -> int:
    """Greedy on xp: the argmax kernel on the device (lowest id on ties), np.argmax as twin."""
    if xp is np:
        return greedy(logits)
    from ds4.kernels import sampling as kernels

    out = xp.zeros(1, dtype=xp.int32)
    kernels.argmax(logits, out)
    return int(out[0])

"""The draft/verify policy of greedy jobs (docs/ARCHITECTURE.md, Speculative decoding).

A greedy job on an engine with an MTP block takes its tokens in rounds: the token its logits
choose, up to `draft` MTP drafts of the tokens after it, then one verify pass that keeps the
drafts greedy decoding confirms. Output is token for token that of plain greedy decoding.
Sampled jobs decode normally. A job that speculates decodes alone: the scheduler never puts it
in a lock-step batch (the batched step has no verify pass); sampled jobs still batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds4.sampling import is_greedy
from ds4.tokenizer import EOS_ID

if TYPE_CHECKING:
    from ds4.engine import Session
    from ds4.jobs.events import SamplingOptions

MAX_DRAFT = 16


@dataclass(frozen=True)
class SpeculationConfig:
    """`--mtp-draft N` drafts per round (1..16) and `--mtp-margin X`: a draft is proposed only
    when the MTP's top-1 logit beats its runner-up by at least X (0: always)."""

    draft: int = 1
    margin: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.draft <= MAX_DRAFT:
            raise ValueError(f"--mtp-draft must be 1..{MAX_DRAFT}, got {self.draft}")
        if not self.margin >= 0:
            raise ValueError(f"--mtp-margin must be >= 0, got {self.margin}")


@dataclass
class SpeculationStats:
    """Counters of draft/verify rounds (plain ints: the server reads them from another thread).

    A verify round is one that verified at least one draft; a step that proposed none (the
    margin, no MTP input yet) is a `plain_step`.
    """

    verify_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0

    def observe(self, drafted: int, accepted: int) -> None:
        """Count one round that verified `drafted` drafts and kept `accepted` of them."""
        if drafted == 0:
            self.plain_steps += 1
            return
        self.verify_rounds += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over verified drafts (0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens a verify round emits on average (1 + its accepted drafts; 0 before any)."""
        if not self.verify_rounds:
            return 0.0
        return (self.verify_rounds + self.accepted) / self.verify_rounds

    def summary(self) -> str:
        """One line for `ds4 generate`'s report."""
        return (f"mtp: {self.verify_rounds} verify rounds, {self.accepted}/{self.drafted} "
                f"drafts accepted ({100 * self.acceptance_rate:.1f}%), "
                f"{self.tokens_per_round:.2f} tokens per verify round, "
                f"{self.plain_steps} steps without a draft")


class DraftOracle:
    """Forced acceptance, for benchmarks and tests: where the held tokens and the next one
    start a known greedy continuation, the drafts are its next tokens (the verify accepts them
    all), so a round shows the ceiling of speculation. The MTP block still runs."""

    def __init__(self, references: Sequence[Sequence[int]]):
        self.references = [list(r) for r in references]

    def proposals(self, held: Sequence[int], first: int, count: int) -> list[int] | None:
        """The next `count` reference tokens after held + [first] (None: no reference)."""
        prefix = list(held) + [int(first)]
        for ref in self.references:
            if len(ref) > len(prefix) and ref[: len(prefix)] == prefix:
                return ref[len(prefix) : len(prefix) + count]
        return None


class Speculator:
    """Runs one job's rounds on its session and counts them."""

    def __init__(self, config: SpeculationConfig, stats: SpeculationStats | None = None,
                 oracle: DraftOracle | None = None):
        self.config = config
        self.stats = stats if stats is not None else SpeculationStats()
        self.oracle = oracle

    def applies(self, sampling: SamplingOptions) -> bool:
        """True for greedy sampling options (the only ones whose drafts can be verified here)."""
        return is_greedy(sampling)

    def round(self, session: Session, first: int, room: int) -> list[int]:
        """`first` and what the session's verify keeps of the drafts after it, at most `room`
        tokens in all (what the burst and the cap leave); the session holds them after."""
        count = min(self.config.draft, room - 1)
        drafts = session.draft(first, count, self.config.margin) if count > 0 else []
        if self.oracle is not None and count > 0:
            known = self.oracle.proposals(session.tokens, first, count)
            drafts = drafts if known is None else known
        if EOS_ID in drafts:  # greedy decoding ends there: no token after it is wanted
            drafts = drafts[: drafts.index(EOS_ID)]
        took = session.verify(first, drafts)
        self.stats.observe(len(drafts), len(took) - 1)
        return took

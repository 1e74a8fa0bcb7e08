"""Work by time, not by count (OuterConfig(work="time"), docs/outer-loop.md, "Work by time"): a
region whose GPUs are slower or fewer runs fewer inner steps between two syncs, instead of the
others idling at every sync until it catches up.

Training runs in rounds. A round's budget is T = H x the slowest region's inner step (H the
schedule's sync_every), and region r runs H_r = max(F, tau + 1, round(T / step_r)) inner steps
in it; fragment f syncs after step f*H_r//F of the region's round, fragment 0 at its end (the
round boundary). Every region issues the same syncs in the same order whatever its count, so the
collectives across regions match. At each boundary every rank's median inner step time and its
samples over the round are gathered (one small all-gather across all ranks), and from them,
identically on every rank:

    H_r of every region for the next round        # round_steps
    w_r = R n_r / N                               # sample_weights, with weighting="samples":
                                                  #   region r's pseudo-gradients are scaled by
                                                  #   w_r before the exchange sums them and
                                                  #   divides by R, so the mean is
                                                  #   sum_r n_r Delta_r / N
    samples_done += N                             # the run's clock, the same on every rank

The first round, before anything is measured, has H_r = H in every region. The weights of the
last boundary serve every sync up to the next one: exact for fragment 0 (and for F = 1), an
estimate from the last round for the other fragments, whose syncs straddle two rounds. The
default, weighting="equal", averages the regions alike: on regions 2x and 4x slower it trained
as well or better than weighting by samples (docs/outer-loop.md).

With work="steps" (the default) rounds are the H steps between two syncs of fragment 0, alike in
every region; nothing is gathered, and samples_done adds this rank's samples x the world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def round_steps(
    sync_every: int, step_s: Sequence[float], fragments: int, overlap: int
) -> tuple[int, ...]:
    """H_r of each region (by region index) from their inner step times: as many steps as fit in
    the slowest region's H steps (which itself runs H), at least one sync step per fragment and
    more than the overlap (a fragment's exchange is merged before its next sync). A region that
    timed no step (0: AMP skipped them all) runs H."""
    budget = sync_every * max(step_s)
    least = max(fragments, overlap + 1)
    return tuple(max(least, round(budget / s) if s > 0 else sync_every) for s in step_s)


def sample_weights(samples: Sequence[int]) -> tuple[float, ...] | None:
    """R n_r / N of each region (by region index): the scale of its pseudo-gradients that makes
    the exchange's mean sample-weighted. None where every region trained on as many samples (the
    plain mean, bit for bit) or none trained."""
    total = sum(samples)
    if total == 0 or len(set(samples)) == 1:
        return None
    return tuple(len(samples) * n / total for n in samples)


def region_totals(
    reports: Sequence[Sequence[float]], members: Sequence[Sequence[int]]
) -> tuple[list[float], list[int]]:
    """Each region's step time (its slowest rank's: the region's ranks step together) and
    samples (its ranks' sum), from every rank's (median step seconds, samples), by rank."""
    step_s = [max(reports[r][0] for r in ranks) for ranks in members]
    samples = [sum(int(reports[r][1]) for r in ranks) for ranks in members]
    return step_s, samples


@dataclass
class Rounds:
    """Where this region is in its round and what the last boundary decided."""

    start: int = 0
    """This region's step (gradient syncs done) at the start of the round."""
    steps: tuple[int, ...] | None = None
    """H_r of every region in this round (by region index); None: the schedule's H everywhere."""
    weights: tuple[float, ...] | None = None
    """w_r of every region for the syncs until the next boundary; None: the plain mean."""
    samples_at_start: int = 0
    """This rank's samples (its counter) at the start of the round."""
    samples_done: int = 0
    """Samples of the run over all regions, up to the last boundary."""
    index: int = 0
    """Rounds done: with H, what labels a sync's exchange alike in every region."""

    def state_dict(self, samples_now: int) -> dict[str, Any]:
        """The round as saved: the samples of this round so far, not the counter (a resumed run's
        counter starts again from 0)."""
        return {
            "start": self.start,
            "steps": None if self.steps is None else list(self.steps),
            "weights": None if self.weights is None else list(self.weights),
            "in_round": samples_now - self.samples_at_start,
            "samples_done": self.samples_done,
            "index": self.index,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], samples_now: int) -> Rounds:
        steps, weights = state["steps"], state["weights"]
        return cls(
            int(state["start"]),
            None if steps is None else tuple(int(h) for h in steps),
            None if weights is None else tuple(float(w) for w in weights),
            samples_now - int(state["in_round"]),
            int(state["samples_done"]),
            int(state["index"]),
        )

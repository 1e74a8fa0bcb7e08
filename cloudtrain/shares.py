"""Batch shares: each rank's part of the step's global batch, by its measured throughput.

    config = cloudtrain.CompressionConfig(global_batch=256)     # "auto" plans the shares
    model = cloudtrain.CloudDDP(model, config)
    loader = DataLoader(data, batch_sampler=cloudtrain.ShareSampler(data, model))
    for x, y in loader:                                         # or: n = model.batch_size()
        loss_fn(model(x), y).backward()                         # the mean over this rank's batch
        opt.step(); opt.zero_grad()

Synchronous data parallelism runs at the pace of its slowest rank: with equal batches, a rank on a
GPU twice as fast idles half of every step. With `global_batch` set, the controller (cloudtrain.
controller) measures each rank's throughput - samples per second of its own compute, from the
steps themselves, smoothed (Estimates.throughput) - and gives each rank a share of the global batch
in proportion (`plan_shares`), so that all ranks finish their compute at about the same time. The
shares change only where that shortens the step by more than SHARE_MARGIN (hysteresis: equal ranks
keep equal shares through the noise of their measurements), and each change takes effect
SHARE_LEAD steps after the decision reached the ranks, so that a data loader's prefetched batches
were drawn with the shares in force at their step.

Rank r's gradient, the mean over its b_r samples, is weighted by b_r / B in the reduction (the
hook's scale, in place of DDP's 1 / world size), so the sum is exactly the mean over the global
batch of B samples, and every replica gets the same bits. With equal shares the weight is 1 /
world size: today's math, bit for bit.

`ShareSampler` is a batch sampler that walks one permutation of the dataset per epoch, identical
on every rank, and gives each rank its share of each step's B indices (rank r the ones after its
lower-ranked peers' shares): the ranks' batches of a step are always the step's global batch.
`BatchShares` is the schedule both read: the shares in force from each step on, the same on every
rank, saved with the controller's state.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import torch

SHARE_MARGIN = 0.1
"""New shares are taken only where they shorten the step's compute (the slowest rank's) by more
than this share of it, as predicted from the smoothed throughputs."""

SHARE_LEAD = 8
"""Steps between a decision reaching the ranks and its shares taking effect: what a data loader
may have prefetched (num_workers x prefetch_factor batches; 2 x 2 by default) must have been drawn
with the shares of its step. A sampler further ahead raises (BatchShares.check_lead)."""


def equal_shares(global_batch: int, ranks: int) -> tuple[int, ...]:
    """The global batch split as evenly as integers allow (the first ranks one more)."""
    base, extra = divmod(global_batch, ranks)
    return tuple(base + (r < extra) for r in range(ranks))


def check_global_batch(global_batch: int, ranks: int) -> None:
    if global_batch < ranks:
        raise ValueError(
            f"global_batch={global_batch} cannot give each of the {ranks} ranks a sample: every "
            f"rank needs at least one per step; use global_batch >= {ranks}"
        )


def proportional(global_batch: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Integers summing to global_batch in proportion to `weights` (largest remainder), at least
    one each."""
    ranks = len(weights)
    check_global_batch(global_batch, ranks)
    total = sum(weights)
    free = global_batch - ranks  # one sample each first, the rest by weight
    ideal = [free * w / total for w in weights]
    shares = [math.floor(x) for x in ideal]
    order = sorted(range(ranks), key=lambda r: (shares[r] - ideal[r], r))
    for r in order[: free - sum(shares)]:
        shares[r] += 1
    return tuple(s + 1 for s in shares)


def share_slice(shares: Sequence[int], rank: int) -> slice:
    """Rank `rank`'s part of a global batch split into `shares`: after its lower ranks' parts."""
    lo = sum(shares[:rank])
    return slice(lo, lo + shares[rank])


def compute_seconds(shares: Sequence[int], throughput: Sequence[float]) -> float:
    """The step's compute under `shares`: the slowest rank's."""
    return max(b / t for b, t in zip(shares, throughput, strict=True))


def plan_shares(
    global_batch: int,
    throughput: Sequence[float | None],
    current: Sequence[int],
    margin: float = SHARE_MARGIN,
) -> tuple[int, ...]:
    """The shares for the next steps: in proportion to the ranks' throughputs (samples/s), or
    `current` unless that shortens the slowest rank's compute by more than `margin` (or some rank's
    throughput is not measured yet)."""
    if len(throughput) != len(current) or any(
        t is None or not t > 0 or not math.isfinite(t) for t in throughput
    ):
        return tuple(current)
    rates = [float(t) for t in throughput]  # type: ignore[arg-type]
    proposed = proportional(global_batch, rates)
    if compute_seconds(proposed, rates) < (1 - margin) * compute_seconds(current, rates):
        return proposed
    return tuple(current)


class BatchShares:
    """The schedule of shares (module docstring): from which step on each set is in force."""

    def __init__(self, global_batch: int, ranks: int) -> None:
        check_global_batch(global_batch, ranks)
        self.global_batch, self.ranks = global_batch, ranks
        self.changes: list[tuple[int, tuple[int, ...]]] = [(0, equal_shares(global_batch, ranks))]
        self.drawn_through = -1
        """The last step a ShareSampler of this rank drew a batch for."""

    def at(self, step: int) -> tuple[int, ...]:
        """Every rank's share at `step`."""
        for start, shares in reversed(self.changes):
            if start <= step:
                return shares
        return self.changes[0][1]

    @property
    def latest(self) -> tuple[int, ...]:
        return self.changes[-1][1]

    def weight(self, step: int, rank: int, world: int) -> float:
        """The factor of rank `rank`'s gradient at `step`: its share of the global batch (1 / world
        with equal shares, computed as DDP does)."""
        shares = self.at(step)
        if all(s == shares[0] for s in shares):
            return 1.0 / world
        return shares[rank] / self.global_batch

    def change(self, step: int, shares: Sequence[int]) -> bool:
        """The decision applied at `step` (on every rank): `shares` from step + SHARE_LEAD on.
        False where they are the shares in force."""
        shares = tuple(int(s) for s in shares)
        if shares == self.latest:
            return False
        if len(shares) != self.ranks or sum(shares) != self.global_batch or min(shares) < 1:
            raise ValueError(f"batch shares {shares} do not split {self.global_batch} samples")
        self.check_lead(step)
        start = step + SHARE_LEAD
        self.changes = [c for c in self.changes if c[0] < start] + [(start, shares)]
        if len(self.changes) > 2 and self.changes[1][0] <= step:  # the ones no step reads again
            self.changes = self.changes[1:]
        return True

    def check_lead(self, step: int) -> None:
        if self.drawn_through >= step + SHARE_LEAD:
            raise RuntimeError(
                f"cloudtrain.ShareSampler drew the batch of step {self.drawn_through} while "
                f"training was at step {step}: a data loader may run at most {SHARE_LEAD - 1} "
                f"steps ahead (cloudtrain.shares.SHARE_LEAD = {SHARE_LEAD}), or its batches would "
                "not match the shares in force at their step; keep num_workers x prefetch_factor "
                f"under {SHARE_LEAD}"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "changes": [(s, list(b)) for s, b in self.changes],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["global_batch"]) != self.global_batch:
            raise ValueError(
                f"the saved batch shares split a global batch of {state['global_batch']}, this "
                f"run's is {self.global_batch}: resume with the same global_batch"
            )
        changes = [(int(s), tuple(int(x) for x in b)) for s, b in state["changes"]]
        if any(len(b) != self.ranks for _, b in changes):
            # another number of ranks: equal shares again, measured anew
            changes = [(0, equal_shares(self.global_batch, self.ranks))]
        self.changes = changes

    def snapshot(self, step: int) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "in_force": list(self.at(step)),
                "planned": list(self.latest)}  # fmt: skip


class ShareSampler(torch.utils.data.Sampler[list[int]]):
    """A batch sampler giving this rank its share of every step's global batch (module docstring).

    dataset: a sized dataset (or its length). model: the CloudDDP it feeds, built with
    CompressionConfig(global_batch=...). shuffle, seed: one permutation per epoch, the same on
    every rank (seed + epoch; torch's global RNG is never touched). An epoch is the dataset's
    len // global_batch steps; the last, partial global batch is dropped. state_dict() /
    load_state_dict(): where it is (epoch, step in the epoch), to resume exactly."""

    def __init__(self, dataset: Any, model: Any, *, shuffle: bool = True, seed: int = 0) -> None:
        shares = getattr(getattr(model, "comm", None), "shares", None)
        if shares is None:
            raise ValueError(
                "ShareSampler(dataset, model): model must be the cloudtrain.CloudDDP this sampler "
                "feeds, built with CompressionConfig(global_batch=N) - it plans the shares"
            )
        self.model, self.shares = model, shares
        if not (isinstance(dataset, int) and not isinstance(dataset, bool)) and not hasattr(
            dataset, "__len__"
        ):
            raise ValueError(
                f"ShareSampler: dataset is a {type(dataset).__name__} without a length; give a "
                "map-style dataset (len() and indexing) or its number of samples"
            )
        if (
            not isinstance(shuffle, bool)
            or isinstance(seed, bool)
            or not isinstance(seed, numbers.Integral)
        ):
            raise ValueError(
                f"ShareSampler: shuffle={shuffle!r} must be True or False and seed={seed!r} an int"
            )
        self.size = dataset if isinstance(dataset, int) else len(dataset)
        if self.size < shares.global_batch:
            raise ValueError(
                f"ShareSampler: the dataset has {self.size} samples, fewer than one global batch "
                f"({shares.global_batch}); use a smaller global_batch or more data"
            )
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.position = 0, 0  # the next step to draw: position of epoch

    def __len__(self) -> int:
        return self.size // self.shares.global_batch

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=gen)

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the epoch (all of it after the last one ended), from the first step not
        trained yet: what an iterator left before (a loop broken out of, for an evaluation)
        drew ahead and its loader threw away is drawn again, not skipped. So a new iterator is
        opened once the batches drawn before are trained or thrown away (as a `for` loop over
        the loader does)."""
        self.epoch, self.position = self._trained()
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order, batch = self._order(), self.shares.global_batch
        rank = self.model.comm.topo.rank
        step = self.model.steps_done  # the step the first batch drawn now is for
        while self.position < len(self):
            mine = share_slice(self.shares.at(step), rank)
            start = self.position * batch
            self.shares.drawn_through = step
            self.position += 1
            step += 1
            yield order[start + mine.start : start + mine.stop].tolist()

    def _trained(self) -> tuple[int, int]:
        """(epoch, position) of the first step drawn and not trained on yet."""
        done = self.model.steps_done
        ahead = max(self.shares.drawn_through + 1 - done, 0)  # drawn, not yet trained on
        epoch, position = self.epoch, self.position - ahead
        while position < 0:  # (the prefetched batches began in the epoch before)
            epoch, position = epoch - 1, position + len(self)
        return epoch, position

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is: take it at the step the model's state is taken (what a loader
        prefetched is drawn again after a resume)."""
        epoch, position = self._trained()
        return {"epoch": epoch, "position": position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.shares.drawn_through = -1  # nothing drawn ahead of the state loaded

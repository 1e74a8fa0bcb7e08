"""What CloudDDP counts and times: `CommStats` (public, `CloudDDP.stats()`) and `Observations`
(what the controller is shown at each decision).

`CommStats.wan_bytes_sent` counts every byte this rank sends to another region, whatever path
the step took: the compressed packets (header included) and, for steps that cross as one plain
all-reduce, this rank's share of the ring - gloo's ring all-reduce sends 2 (n-1)/n of the buffer
to the next rank, so a rank whose successor is in another region sends that much across. Summed
over ranks it is what the shaped links' interface counters show, less TCP/IP headers.

`Observations` is one rank's measurements since the last decision: compute time of each step,
the arrival time of every packet received from each region, seconds per step of each stage, and
what the zstd stage would do to its own packets.
The controller gathers them from all ranks; it never reads the hook's state.

`Scalars` writes one rank's metrics for TensorBoard (the controller's at its decisions, an
elastic region's membership at its syncs).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

TRIAL_BYTES = 1 << 20
"""Bytes of packets the zstd stage is tried on per decision interval (a quarter of them at most
from one packet, sampled across it): a few ms of CPU."""

STAGES = ("allreduce", "intra_reduce", "encode", "exchange", "decode", "intra_gather", "guard")
"""Stages of a bucket's path, as timed in CommStats.seconds."""


@dataclass
class CommStats:
    """Counters of one rank's communication since the run started (resumes included)."""

    steps: int = 0
    """Optimizer steps whose gradients were reduced (no_sync steps are not counted)."""
    buckets: int = 0
    """Gradient buckets per step, as DDP hands them over."""
    wan_bytes_sent: int = 0
    """Bytes this rank sent to other regions, on every path (module docstring)."""
    compressed_steps: int = 0
    """Steps whose gradients crossed regions as packets (the rest: plain all-reduce)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each stage (STAGES), this process only (not restored on resume)."""
    controller: dict[str, Any] | None = None
    """With "auto": what the controller believes and decided last - each region's link
    estimate, the plan in force and the quality guard's measurements and ceilings
    (`Controller.snapshot`); filled by `CloudDDP.stats()`."""
    elastic: dict[str, Any] | None = None
    """In an elastic run: the regions present, membership changes, regions lost, joined and
    refused, failed syncs, pauses, bytes and seconds spent moving state to joiners, the longest
    sync (`cloudtrain.elastic.ElasticStats`); filled by `CloudDDP.stats()`."""

    def copy(self) -> CommStats:
        return copy.deepcopy(self)

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(stage, time.perf_counter() - t0)

    def add_seconds(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "buckets": self.buckets,
            "wan_bytes_sent": self.wan_bytes_sent,
            "compressed_steps": self.compressed_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.buckets = int(state["buckets"])
        self.wan_bytes_sent = int(state["wan_bytes_sent"])
        self.compressed_steps = int(state.get("compressed_steps", 0))
        self.seconds = {}


def ring_wan_bytes(nbytes: int, rank: int, rank_regions: tuple[str, ...]) -> int:
    """Bytes this rank sends across regions in a ring all-reduce of `nbytes` (module docstring)."""
    n = len(rank_regions)
    if n < 2 or rank_regions[(rank + 1) % n] == rank_regions[rank]:
        return 0
    return 2 * (n - 1) * nbytes // n


@dataclass
class Observations:
    """One rank's measurements since the controller's last decision."""

    compute_s: list[float] = field(default_factory=list)
    """Seconds of compute (forward + backward until the last bucket) of each step."""
    samples: list[int] = field(default_factory=list)
    """Samples of each step whose compute is in compute_s (CloudDDP.forward counts them)."""
    step_s: list[float] = field(default_factory=list)
    """Seconds of each whole step, from the end of one step's communication to the next's."""
    arrivals: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    """Sender region -> (packet bytes, seconds until it arrived) of each packet received."""
    stage_s: dict[str, float] = field(default_factory=dict)
    """Seconds per step spent in each stage."""
    zstd: list[tuple[float, float, float, int]] = field(default_factory=list)
    """The zstd stage tried on this rank's own packets at the rung its region sent with: ratio,
    encode and decode seconds per byte (ZstdGain) and the bytes tried, up to TRIAL_BYTES per
    interval."""
    quality: Any = None
    """The quality probe's sums over the interval (cloudtrain.guard.QualitySums), on shard
    owners."""


class Observer:
    """Collects Observations on the training and communication threads."""

    __slots__ = ("_current", "_seconds_seen", "_step_start", "_steps", "_tried")

    def __init__(self) -> None:
        self._current = Observations()
        self._step_start: float | None = None
        self._seconds_seen: dict[str, float] = {}
        self._steps = 0
        self._tried = 0

    def step_started(self) -> None:
        """The previous step's communication is done: compute of the next one starts."""
        now = time.monotonic()
        if self._step_start is not None:
            self._current.step_s.append(now - self._step_start)
        self._step_start = now
        self._steps += 1

    def compute_finished(self, samples: int = 0) -> None:
        """The step's last bucket was handed over: its compute (of `samples`) is done."""
        if self._step_start is not None:
            self._current.compute_s.append(time.monotonic() - self._step_start)
            self._current.samples.append(samples)

    def exclude(self, seconds: float) -> None:
        """`seconds` of the step now running were neither its compute nor its communication (a
        re-probe of the links, waiting for a decision): left out of both."""
        if self._step_start is not None:
            self._step_start += seconds

    def arrived(self, region: int, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self._current.arrivals.setdefault(region, []).append((nbytes, seconds))

    def zstd_trial_due(self) -> bool:
        """Whether the next packet encoded should try the zstd stage too: until TRIAL_BYTES were
        tried in this interval (the communication thread asks; `take` starts a new interval
        between steps, when that thread is idle)."""
        return self._tried < TRIAL_BYTES

    def zstd_tried(self, gain: Any, nbytes: int) -> None:
        self._tried += nbytes
        self._current.zstd.append(
            (gain.ratio, gain.encode_s_per_byte, gain.decode_s_per_byte, nbytes)
        )

    def take(self, stats: CommStats) -> Observations:
        """What was seen since the last call, with stage seconds per step from `stats`."""
        seen, self._current = self._current, Observations()
        steps = max(self._steps, 1)
        now = dict(stats.seconds)
        seen.stage_s = {k: (v - self._seconds_seen.get(k, 0.0)) / steps for k, v in now.items()}
        self._seconds_seen, self._steps, self._tried = now, 0, 0
        return seen

    def reset(self) -> None:
        """After a resume: stage times start again from zero."""
        self._current, self._seconds_seen, self._steps = Observations(), {}, 0
        self._tried = 0


class Scalars:
    """TensorBoard scalars of one rank in `folder` (torch.utils.tensorboard's SummaryWriter,
    made at the first write). Without the tensorboard package: one warning, nothing written."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._writer: Any = None
        self._missing = False

    def write(self, step: int, values: dict[str, float]) -> None:
        if self._missing:
            return
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logging.getLogger("cloudtrain").warning(
                    "cloudtrain: tensorboard is not installed; metrics go to the log only"
                )
                self._missing = True
                return
            self._writer = SummaryWriter(self.folder)
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

"""Classify each GPU's window of samples into one of five states.

Windows are at least 5 s long because NVML's power reading is itself a moving
average (about 1 s on recent drivers) and a single sample says little. Per GPU
and window the classifier takes the median power (robust to the averaging lag
at a state change), the mean utilisation and the median memory in use, and
places the power on the job's own dynamic range::

    x = (power - idle_with_context) / (job compute level - idle_with_context)

The job's compute level is the running median power of its own compute
windows, seeded from the calibration's compute band, so a memory-bound job that
never reaches the card's typical compute power is still judged against itself.

=========================  ===============================================
state                      rule
=========================  ===============================================
idle                       x < stall_below, kernels idle, job memory freed
checkpoint-or-deadlock     x < stall_below otherwise: the job holds its
                           memory (checkpoint, host-side wait) or a kernel
                           spins at 100 % without drawing power (NCCL hang)
compute                    x >= compute_above
communication              in between, utilisation >= busy_util
data-starvation            in between, utilisation < busy_util (the GPU
                           idles between bursts, waiting for batches)
=========================  ===============================================

Power alone cannot tell a checkpoint from a deadlock; the heartbeat can
(``watchdog.DeadlockDetector``).
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from tuneloop.telemetry.calibration import Calibration
from tuneloop.telemetry.trace import Sample, State

# Below this mean utilisation (%) no kernel is meaningfully running.
IDLE_UTIL = 5.0
# Memory counts as "the job's" when it holds at least this share of the card (before the
# job's own level is known) or half of what its compute windows held.
RESIDENT_MIN_FRAC = 0.05
RESIDENT_OF_LEVEL = 0.5
# Compute windows remembered for the running level: about 5 minutes at 5 s windows,
# long enough to ride out a slow phase, short enough to follow a new phase of the job.
LEVEL_HISTORY = 64
# A reading at least this far up the job's range counts as a burst of work.
BURST_HIGH = 0.5

BUSY: frozenset[State] = frozenset({"compute", "communication", "data-starvation"})
STALLED: frozenset[State] = frozenset({"checkpoint-or-deadlock", "idle"})
# Ties in the job-level vote go to the reading that matters for a hang.
_TIE_ORDER: tuple[State, ...] = (
    "checkpoint-or-deadlock",
    "idle",
    "data-starvation",
    "communication",
    "compute",
)


@dataclass(frozen=True, slots=True)
class WindowFeatures:
    gpu: int
    t0: float
    t1: float
    n: int
    power_w: float | None  # median reading
    power_min_w: float | None
    power_max_w: float | None
    switches: int  # times the readings cross halfway between their min and max: bursts > 1
    energy_j: float | None  # energy counter delta across the window, when the card has one
    gpu_util: float | None  # mean
    mem_util: float | None  # mean
    mem_used_mib: float | None  # median
    label: State | None = None  # ground truth (majority of the samples), synthetic traces only
    pure: bool = False  # every sample carries ``label``


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _switches(values: Sequence[float]) -> int:
    if len(values) < 2:
        return 0
    middle = (min(values) + max(values)) / 2
    above = [v >= middle for v in values]
    return sum(a != b for a, b in itertools.pairwise(above))


def window_features(gpu: int, t0: float, t1: float, samples: Sequence[Sample]) -> WindowFeatures:
    powers = [s.power_w for s in samples if s.power_w is not None]
    energies = [s.energy_j for s in samples if s.energy_j is not None]
    energy = energies[-1] - energies[0] if len(energies) >= 2 else None
    labels = Counter(s.label for s in samples if s.label is not None)
    label, count = labels.most_common(1)[0] if labels else (None, 0)
    return WindowFeatures(
        gpu=gpu,
        t0=t0,
        t1=t1,
        n=len(samples),
        power_w=_median(powers),
        power_min_w=min(powers) if powers else None,
        power_max_w=max(powers) if powers else None,
        switches=_switches(powers),
        energy_j=energy,
        gpu_util=_mean([s.gpu_util for s in samples]),
        mem_util=_mean([s.mem_util for s in samples]),
        mem_used_mib=_median([s.mem_used_mib for s in samples]),
        label=label,
        pure=label is not None and count == len(samples),
    )


class GpuClassifier:
    """Classifies one GPU's windows and keeps that GPU's running compute level."""

    def __init__(
        self,
        calibration: Calibration,
        power_cap_w: float | None,
        memory_total_mib: float | None,
    ) -> None:
        self.calibration = calibration
        self.cap_w = calibration.cap_w(power_cap_w)
        self.idle_w = calibration.idle_w(self.cap_w, context=True)
        self.memory_total_mib = memory_total_mib
        # Seeded at the bottom of the compute band: a job computing there is recognised
        # at once, and a hotter job pulls the median up within a few windows.
        self.seed_level_w = calibration.bands["compute"][0] * self.cap_w
        self._compute_power: deque[float] = deque(maxlen=LEVEL_HISTORY)
        self._compute_memory: deque[float] = deque(maxlen=LEVEL_HISTORY)

    @property
    def level_w(self) -> float:
        return statistics.median(self._compute_power) if self._compute_power else self.seed_level_w

    def position(self, power_w: float) -> float:
        """Where ``power_w`` sits between idle-with-context (0) and the job's compute level (1)."""
        # A cap set below the card's idle draw would make the range vanish; a tenth of
        # the cap keeps x finite and still orders the states.
        span = max(self.level_w - self.idle_w, 0.1 * self.cap_w)
        return (power_w - self.idle_w) / span

    def _memory_resident(self, mem_used_mib: float | None) -> bool:
        if mem_used_mib is None:
            return True  # unknown: do not call it idle, which would hide a stalled job
        floor = RESIDENT_MIN_FRAC * self.memory_total_mib if self.memory_total_mib else 1024.0
        if self._compute_memory:
            floor = max(floor, RESIDENT_OF_LEVEL * statistics.median(self._compute_memory))
        return mem_used_mib >= floor

    def _bursty(self, window: WindowFeatures) -> bool:
        # Readings that swing from the floor up to work and back: a GPU fed in bursts. The
        # median alone calls that stalled when the instantaneous power field catches the
        # gaps; a state change swings once, so the window after a change (whose first
        # second still averages the old state) is not taken for bursts.
        if window.power_min_w is None or window.power_max_w is None or window.switches < 2:
            return False
        return (
            self.position(window.power_min_w) < self.calibration.stall_below
            and self.position(window.power_max_w) >= BURST_HIGH
        )

    def classify(self, window: WindowFeatures) -> State | None:
        """The window's state, or None without a power reading."""
        if window.power_w is None:
            return None
        cal = self.calibration
        x = self.position(window.power_w)
        util = window.gpu_util
        state: State
        if self._bursty(window) and (util is None or util < cal.busy_util):
            state = "data-starvation"
        elif x < cal.stall_below:
            kernels_idle = util is not None and util < IDLE_UTIL
            if kernels_idle and not self._memory_resident(window.mem_used_mib):
                state = "idle"
            else:
                state = "checkpoint-or-deadlock"
        elif x >= cal.compute_above:
            state = "compute"
        elif util is None or util >= cal.busy_util:
            state = "communication"
        else:
            state = "data-starvation"
        if state == "compute":
            self._compute_power.append(window.power_w)
            if window.mem_used_mib is not None:
                self._compute_memory.append(window.mem_used_mib)
        return state


def job_state(states: Sequence[State | None]) -> State | None:
    """The job's state in a window: the majority over its GPUs."""
    votes = Counter(s for s in states if s is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(s for s in _TIE_ORDER if votes.get(s, 0) == top)


def job_stalled(states: Sequence[State | None]) -> bool | None:
    """Whether at least half the GPUs are stalled (None without power data).

    Half, not all: in data parallelism the other ranks block in their next
    collective within a step, and one GPU whose reading stays high (a rank
    spinning in a compute loop) must not hide the hang.
    """
    known = [s for s in states if s is not None]
    if not known:
        return None
    return 2 * sum(s in STALLED for s in known) >= len(known)

"""The power watchdog on replayed traces: classification, no false alarms, every hang caught.

Synthetic traces (``tuneloop.telemetry.synth``) carry ground truth; the small
CSV fixtures under tests/fixtures/traces go through the same reader a recorded
trace does. NVML itself is the one thing stood in for (there is no GPU here):
``FakeNvml`` drives the real ``NvmlSource`` code.
"""

from __future__ import annotations

import ctypes
import dataclasses
import http.server
import json
import logging
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pynvml
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneloop.cli.host import calibrate_main, watch_main
from tuneloop.telemetry import synth
from tuneloop.telemetry.accounting import Accounting
from tuneloop.telemetry.actions import AlertHook, dump_stacks, send_alert
from tuneloop.telemetry.calibrate import WORKLOADS, calibration_from_measurements
from tuneloop.telemetry.calibration import (
    BUILTIN_MODELS,
    GENERIC,
    CalibrationError,
    builtin_calibration,
    calibration_for,
    calibration_source,
    parse,
)
from tuneloop.telemetry.classify import GpuClassifier, WindowFeatures
from tuneloop.telemetry.heartbeat import (
    HEARTBEAT_ENV,
    Heartbeat,
    HeartbeatRecord,
    clear_heartbeats,
    merge,
    rank_path,
    read_heartbeats,
)
from tuneloop.telemetry.plot import plot_timeline
from tuneloop.telemetry.sampler import NvmlSource, Sampler, TelemetryUnavailable, open_source
from tuneloop.telemetry.trace import (
    STATES,
    DeviceInfo,
    HeartbeatView,
    ReplaySource,
    Sample,
    State,
    Tick,
    Trace,
    TraceError,
    format_trace,
    read_trace,
    write_trace,
)
from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE
from tuneloop.telemetry.watchdog import DeadlockDetector, ReplayResult, WatchConfig, replay

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
D = 20.0  # deadlock_after_s used throughout
CONFIG = WatchConfig(deadlock_after_s=D)
ACCURACY_FLOOR = 0.9


def _false_alarms(result: ReplayResult) -> list[float]:
    first = result.onsets[0] if result.onsets else math.inf
    return [a.t for a in result.alarms if a.t < first]


def _latency(result: ReplayResult) -> float | None:
    onset = result.onsets[0]
    after = [a.t for a in result.alarms if a.t >= onset]
    return after[0] - onset if after else None


@pytest.fixture(scope="module")
def synthetic_runs() -> list[tuple[synth.Scenario, ReplayResult]]:
    runs = []
    for seed in range(24):
        scenario = synth.random_scenario(seed, deadlock=seed % 2 == 1, deadlock_after_s=D)
        runs.append((scenario, replay(synth.generate(scenario), CONFIG)))
    return runs


# --- the three checks the watchdog exists for ------------------------------------------


def test_every_state_is_classified_accurately(
    synthetic_runs: list[tuple[synth.Scenario, ReplayResult]],
) -> None:
    totals = {s: [0, 0] for s in STATES}
    for _, result in synthetic_runs:
        for state, (correct, count) in result.accuracy().items():
            totals[state][0] += correct
            totals[state][1] += count
    for state, (correct, count) in totals.items():
        assert count >= 50, f"too few {state} windows to judge"
        assert correct / count >= ACCURACY_FLOOR, f"{state}: {correct}/{count}"


def test_clean_runs_raise_no_alarm(
    synthetic_runs: list[tuple[synth.Scenario, ReplayResult]],
) -> None:
    clean = [(s, r) for s, r in synthetic_runs if not r.onsets]
    assert len(clean) == 12
    # The clean runs hold long checkpoints and low-power eval pauses.
    longest = max(
        seg.duration_s for s, _ in clean for seg in s.segments if seg.section == "checkpoint"
    )
    assert longest > 3 * D
    assert any(
        seg.section == "eval" and seg.state != "compute" for s, _ in clean for seg in s.segments
    )
    for scenario, result in clean:
        assert result.alarms == [], f"{scenario.name}: {result.alarms[0].reason}"


def test_every_planted_deadlock_is_caught_in_time(
    synthetic_runs: list[tuple[synth.Scenario, ReplayResult]],
) -> None:
    planted = [(s, r) for s, r in synthetic_runs if r.onsets]
    assert len(planted) == 12
    for scenario, result in planted:
        assert _false_alarms(result) == [], scenario.name
        latency = _latency(result)
        assert latency is not None, f"{scenario.name}: deadlock missed"
        assert latency <= D + CONFIG.window_s, f"{scenario.name}: caught after {latency:.1f} s"


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.csv")), ids=lambda p: p.stem)
def test_fixture_traces(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trace = read_trace(path)
    with caplog.at_level(logging.WARNING, logger="tuneloop.telemetry.watchdog"):
        result = replay(trace, CONFIG)
    assert _false_alarms(result) == []
    if path.stem.startswith("deadlock"):
        latency = _latency(result)
        assert latency is not None and latency <= D + CONFIG.window_s
    else:
        assert result.alarms == []
    if path.stem.startswith("starvation"):
        assert result.events, "sustained starvation must warn"
        assert "page cache" in caplog.text and "DataLoader workers" in caplog.text


def test_fixtures_are_small() -> None:
    files = sorted(FIXTURES.glob("*.csv"))
    assert len(files) >= 4
    assert all(f.stat().st_size < 100_000 for f in files)


def test_checkpoint_that_never_ends_is_flagged() -> None:
    scenario = synth.Scenario(
        "stuck-save",
        "h100",
        (
            synth.Segment("idle", 10, variant="context"),
            synth.Segment("compute", 40),
            synth.Segment("checkpoint-or-deadlock", 500, "checkpoint", "host", deadlock=True),
        ),
        seed=3,
    )
    config = WatchConfig(deadlock_after_s=D, section_max_factor=20)
    result = replay(synth.generate(scenario), config)
    (alarm,) = result.alarms
    assert alarm.kind == "section-overrun"
    assert "checkpoint" in alarm.reason
    latency = _latency(result)
    assert latency is not None
    assert config.section_max_s <= latency <= config.section_max_s + config.window_s + 1


def test_without_power_the_heartbeat_alone_catches_the_hang() -> None:
    scenario = synth.random_scenario(101, deadlock=True, deadlock_after_s=D)
    trace = synth.generate(scenario)
    blind = Trace(
        trace.devices,
        tuple(
            dataclasses.replace(
                tick,
                samples=tuple(dataclasses.replace(s, power_w=None) for s in tick.samples),
            )
            for tick in trace.ticks
        ),
    )
    result = replay(blind, CONFIG)
    assert _false_alarms(result) == []
    latency = _latency(result)
    assert latency is not None and latency <= D + CONFIG.window_s
    assert "no power data" in result.alarms[0].reason


# --- the detector's rules ----------------------------------------------------------------


def _feed(
    detector: DeadlockDetector, until: float, view: HeartbeatView | None, t0: float = 0.0
) -> list[str]:
    reasons = []
    t = t0
    while t <= until:
        detector.on_heartbeat(t, view)
        alarm = detector.check(t)
        if alarm is not None:
            reasons.append(alarm.reason)
        t += 0.5
    return reasons


def test_detector_arms_at_the_first_step() -> None:
    detector = DeadlockDetector(WatchConfig(deadlock_after_s=10, section_max_factor=5))
    assert _feed(detector, 100, None) == []  # model loading: no heartbeat yet
    assert _feed(detector, 200, HeartbeatView(None, None), 100) == []  # no step yet
    # One step: its length is unknown, so the heartbeat alone waits a section's maximum.
    assert _feed(detector, 249, HeartbeatView(1, None), 200) == []
    assert len(_feed(detector, 251, HeartbeatView(1, None), 249.5)) == 1
    known = DeadlockDetector(WatchConfig(deadlock_after_s=10))
    _feed(known, 1, HeartbeatView(1, None))
    _feed(known, 2, HeartbeatView(2, None), 1.5)  # two steps: the step time is known
    assert _feed(known, 11, HeartbeatView(2, None), 2) == []
    assert len(_feed(known, 12, HeartbeatView(2, None), 11.5)) == 1  # 10 s after step 2


def test_sections_shield_until_their_maximum() -> None:
    config = WatchConfig(deadlock_after_s=10, section_max_factor=5)
    detector = DeadlockDetector(config)
    _feed(detector, 5, HeartbeatView(3, None))
    assert _feed(detector, 54, HeartbeatView(3, "checkpoint"), 5.5) == []
    (reason,) = _feed(detector, 60, HeartbeatView(3, "checkpoint"), 54.5)
    assert "section 'checkpoint'" in reason


def test_slow_steps_stretch_the_threshold() -> None:
    detector = DeadlockDetector(WatchConfig(deadlock_after_s=10, slow_step_factor=3))
    for step in range(6):
        detector.on_heartbeat(step * 8.0, HeartbeatView(step, None))
    assert detector.threshold_s() == pytest.approx(24.0)
    assert detector.check(40.0 + 20) is None
    assert detector.check(40.0 + 24.5) is not None


def test_power_shields_a_silent_job_only_up_to_the_backstop() -> None:
    config = WatchConfig(deadlock_after_s=10, section_max_factor=10)
    detector = DeadlockDetector(config)
    _feed(detector, 2, HeartbeatView(1, None))
    _feed(detector, 3, HeartbeatView(2, None), 2.5)  # last step at 2.5 s
    t = 5.0
    while t < 102:  # the GPUs keep computing (or a kernel spins hot), no step arrives
        detector.on_window(t - 5, t, stalled=False, busy=True)
        assert detector.check(t) is None
        t += 5
    detector.on_window(t - 5, t, stalled=False, busy=True)
    alarm = detector.check(t)
    assert alarm is not None and "backstop" in alarm.reason


def test_one_rank_in_a_section_does_not_shield_a_hang() -> None:
    records = [
        HeartbeatRecord(0, 100, 12, 1.0, None),
        HeartbeatRecord(1, 101, 11, 1.0, "checkpoint"),
    ]
    assert merge(records) == HeartbeatView(12, None)
    both = [dataclasses.replace(r, section="checkpoint") for r in records]
    assert merge(both) == HeartbeatView(12, "checkpoint")
    assert merge([]) is None


def test_watch_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="window_s"):
        WatchConfig(window_s=2)
    with pytest.raises(ValueError, match="hz"):
        WatchConfig(hz=50)


# --- calibration -------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*BUILTIN_MODELS, GENERIC])
def test_shipped_calibrations_separate_their_bands(name: str) -> None:
    cal = builtin_calibration(name)
    assert cal.estimated and "stimate" in cal.source
    cap = cal.tdp_w or 400.0
    low, high = cal.bands["compute"]
    for level in (low, (low + high) / 2):  # the seed, and a typical learned level
        classifier = GpuClassifier(cal, cap, None)
        watts = level * cap
        steady = WindowFeatures(0, 0.0, 5.0, 10, watts, watts, watts, 0, None, 99.0, 50.0, None)
        assert classifier.classify(steady) == "compute"
        assert classifier.level_w == level * cap

        def x(frac: float, c: GpuClassifier = classifier) -> float:
            return c.position(frac * cap)

        assert x(cal.bands["checkpoint-or-deadlock"][1]) < cal.stall_below
        middle = [cal.bands["communication"], cal.bands["data-starvation"]]
        assert min(x(b[0]) for b in middle) > cal.stall_below
        assert max(x(b[1]) for b in middle) < cal.compute_above
        assert x(low) >= cal.compute_above


@pytest.mark.parametrize(
    ("device", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GH200 480GB", "generic"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA B300 SXM6 AC", "B300"),
        ("Tesla T4", "generic"),
    ],
)
def test_calibration_is_matched_by_device_name(device: str, model: str) -> None:
    assert calibration_for(device).gpu_model == model


def test_calibration_rejects_unknown_keys() -> None:
    data = builtin_calibration("h100").to_json()
    assert parse(data, "round-trip").bands == builtin_calibration("h100").bands
    with pytest.raises(CalibrationError, match="idle_watts"):
        parse({**data, "idle_watts": 3}, "typo.json")


def _workload_samples(workload: str) -> list[Sample]:
    segment = {
        "idle-no-context": synth.Segment("idle", 40, variant="no-context"),
        "idle-context": synth.Segment("idle", 40, variant="context"),
        "compute": synth.Segment("compute", 40),
        "communication": synth.Segment("communication", 40),
        "data-starvation": synth.Segment("data-starvation", 40),
        "checkpoint": synth.Segment("checkpoint-or-deadlock", 40, variant="host"),
    }[workload]
    scenario = synth.Scenario(workload, "h100", (segment,), n_gpus=1, hz=10.0, seed=7)
    return [s for tick in synth.generate(scenario).ticks for s in tick.samples]


def test_calibration_from_measurements_separates_the_states() -> None:
    measurements = {w: _workload_samples(w) for w in WORKLOADS}
    cal = calibration_from_measurements("h100-test", ["H100"], 700.0, 700.0, measurements, "test")
    assert not cal.estimated
    assert cal.idle_context_w is not None and 100 < cal.idle_context_w < 130
    assert 0.0 < cal.stall_below < cal.compute_above < 1.0
    assert parse(cal.to_json(), "measured").stall_below == cal.stall_below
    shipped = builtin_calibration("h100")
    assert calibration_source([cal, cal]) == "measured"
    assert calibration_source([cal, shipped]) == "estimate"  # one estimated card is enough
    assert calibration_source([]) == "none"
    overlapping = {**measurements, "checkpoint": measurements["communication"]}
    with pytest.raises(CalibrationError, match="overlaps"):
        calibration_from_measurements("bad", [], 700.0, 700.0, overlapping, "test")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_calibrate_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert calibrate_main(["--seconds", "1"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


# --- sampling through NVML ---------------------------------------------------------------


class FakeNvml:
    """Stands in for the pynvml module: there is no GPU here. Constants are pynvml's own."""

    NVMLError = pynvml.NVMLError
    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_FI_DEV_POWER_INSTANT = pynvml.NVML_FI_DEV_POWER_INSTANT
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_VALUE_TYPE_DOUBLE = pynvml.NVML_VALUE_TYPE_DOUBLE
    NVML_VALUE_TYPE_UNSIGNED_INT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    NVML_VALUE_TYPE_UNSIGNED_LONG = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    NVML_VALUE_TYPE_SIGNED_LONG_LONG = pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG
    NVML_VALUE_TYPE_SIGNED_INT = pynvml.NVML_VALUE_TYPE_SIGNED_INT

    def __init__(self, instant: bool = True, energy: bool = True, init_ok: bool = True) -> None:
        self.instant, self.energy, self.init_ok = instant, energy, init_ok
        self.shut_down = False

    def nvmlInit(self) -> None:
        if not self.init_ok:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"  # older bindings return bytes

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return 700_000

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=80 * 2**30, used=(40 + handle) * 2**30)

    def nvmlDeviceGetFieldValues(self, handle: int, ids: list[int]) -> Any:
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        values[0].fieldId = ids[0]
        values[0].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        values[0].nvmlReturn = (
            pynvml.NVML_SUCCESS if self.instant else pynvml.NVML_ERROR_NOT_SUPPORTED
        )
        values[0].value.uiVal = ctypes.c_uint(650_000 + handle).value
        return values

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 640_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        if not self.energy:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 123_456_789

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=100, memory=42)

    def nvmlDeviceGetClockInfo(self, handle: int, kind: int) -> int:
        return 1980 if kind == pynvml.NVML_CLOCK_SM else 2619


def test_nvml_source_prefers_instantaneous_power() -> None:
    source = NvmlSource.open(nvml=FakeNvml())
    (device, _) = source.devices()
    assert device == DeviceInfo(0, "NVIDIA H100 80GB HBM3", 700.0, 80 * 1024.0, "instant")
    first, second = source.read(5.0)
    assert (first.t, first.power_w, second.power_w) == (5.0, 650.0, 650.001)
    assert first.energy_j == pytest.approx(123_456.789)
    assert (first.gpu_util, first.mem_util, first.mem_used_mib) == (100.0, 42.0, 40 * 1024.0)
    assert (first.sm_clock_mhz, first.mem_clock_mhz) == (1980.0, 2619.0)
    source.close()


def test_nvml_source_falls_back_to_average_power(caplog: pytest.LogCaptureFixture) -> None:
    source = NvmlSource.open(nvml=FakeNvml(instant=False, energy=False))
    assert source.devices()[0].power_field == "average"
    with caplog.at_level(logging.WARNING):
        samples = source.read(1.0) + source.read(2.0)
    assert {s.power_w for s in samples} == {640.0}
    assert {s.energy_j for s in samples} == {None}
    assert caplog.text.count("energy counter") == 2  # once per GPU, not per read


def test_without_nvml_the_sampler_says_so() -> None:
    with pytest.raises(TelemetryUnavailable):
        NvmlSource.open(nvml=FakeNvml(init_ok=False))
    try:  # the real library: absent on this machine, present on a GPU node
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        with pytest.raises(TelemetryUnavailable):
            NvmlSource.open()
        assert open_source() is None
    assert not Sampler(None, hz=2).available


def test_sampler_keeps_a_ring_buffer() -> None:
    trace = synth.generate(synth.fixture_scenarios()[0])
    sampler = Sampler(ReplaySource(trace), hz=1.0, buffer_s=30)
    for tick in trace.ticks[:100]:
        sampler.poll(tick.t)
    assert len(sampler.ring) == 30 * 2
    assert sampler.recent(trace.ticks[95].t)[0].t == trace.ticks[95].t


# --- traces ------------------------------------------------------------------------------

_value = st.one_of(st.none(), st.floats(0, 5000, allow_nan=False))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_value, _value, st.none() | st.integers(0, 10**6), st.sampled_from(STATES)),
        min_size=1,
        max_size=20,
    )
)
def test_trace_round_trips(
    rows: list[tuple[float | None, float | None, int | None, State]],
) -> None:
    ticks = tuple(
        Tick(
            float(i),
            (Sample(float(i), 0, power, energy, 50.0, 10.0, 1000.0, label=label),),
            HeartbeatView(step, "checkpoint" if i % 3 == 0 else None),
            deadlock=i % 2 == 0,
        )
        for i, (power, energy, step, label) in enumerate(rows)
    )
    trace = Trace((DeviceInfo(0, "NVIDIA H100", 700.0, 81559.0),), ticks)
    back = read_trace_text(format_trace(trace))
    assert back.devices == trace.devices
    assert len(back.ticks) == len(ticks)
    for original, read in zip(ticks, back.ticks, strict=True):
        (a,), (b,) = original.samples, read.samples
        assert read.heartbeat == original.heartbeat and read.deadlock == original.deadlock
        assert b.label == a.label
        for x, y in ((a.power_w, b.power_w), (a.energy_j, b.energy_j)):
            assert (x is None and y is None) or abs((x or 0) - (y or 0)) <= 0.051


def read_trace_text(text: str) -> Trace:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.csv"
        path.write_text(text)
        return read_trace(path)


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    trace = synth.generate(synth.fixture_scenarios()[0])
    path = tmp_path / "t.csv"
    write_trace(path, trace)
    lines = path.read_text().splitlines()
    truncated = tmp_path / "truncated.csv"
    truncated.write_text("\n".join([*lines[:-1], lines[-1][:10]]) + "\n")
    assert len(read_trace(truncated).ticks) == len(trace.ticks)  # the cut row is dropped
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([*lines[:6], lines[6].replace("idle", "napping"), *lines[7:]]))
    with pytest.raises(TraceError, match=r"bad\.csv:7: unknown label 'napping'"):
        read_trace(bad)
    with pytest.raises(TraceError, match="not a tuneloop trace"):
        read_trace_text("t,gpu\n")


def test_replay_source_paces_a_trace() -> None:
    trace = synth.generate(synth.fixture_scenarios()[0])
    source = ReplaySource(trace)
    first = source.read(1000.0)
    assert [s.t for s in first] == [1000.0, 1000.0]
    assert first[0].power_w == trace.ticks[0].samples[0].power_w
    later = source.read(1010.0)  # ten seconds on: the tick recorded ten seconds in
    assert later[0].power_w == trace.ticks[10].samples[0].power_w
    assert source.read(1000.0 + trace.duration_s + 5) == []
    assert source.exhausted


# --- heartbeat ---------------------------------------------------------------------------


def test_heartbeat_files_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hb.json"
    monkeypatch.setenv(HEARTBEAT_ENV, str(path))
    monkeypatch.setenv("RANK", "1")
    rank1 = Heartbeat(min_interval_s=0.0)
    rank0 = Heartbeat(path, rank=0, min_interval_s=0.0)
    assert rank1.path == rank_path(path, 1) == tmp_path / "hb.rank1.json"
    rank0.beat(5)
    rank1.beat(4)
    with rank1.section("checkpoint"):
        records = read_heartbeats(path)
        assert [(r.rank, r.step, r.section) for r in records] == [
            (0, 5, None),
            (1, 4, "checkpoint"),
        ]
    assert read_heartbeats(path)[1].section is None
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp files left
    clear_heartbeats(path)
    assert read_heartbeats(path) == []


def test_heartbeat_is_throttled_but_sections_are_not(tmp_path: Path) -> None:
    hb = Heartbeat(tmp_path / "hb.json", rank=0, min_interval_s=60)
    hb.beat(1)
    hb.beat(2)
    assert read_heartbeats(tmp_path / "hb.json")[0].step == 1
    hb.enter_section("eval")
    assert read_heartbeats(tmp_path / "hb.json")[0].step == 2


def test_heartbeat_without_a_path_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEARTBEAT_ENV, raising=False)
    hb = Heartbeat()
    assert not hb.enabled
    hb.beat(1)
    with hb.section("checkpoint"):
        pass


def test_trainer_callback_marks_saves_and_evals(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from tuneloop.telemetry.callback import HeartbeatCallback

    path = tmp_path / "hb.json"
    callback = HeartbeatCallback(heartbeat=Heartbeat(path, rank=0, min_interval_s=0))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    state, control = TrainerState(global_step=7), TrainerControl()

    def now() -> tuple[int | None, str | None]:
        (record,) = read_heartbeats(path)
        return record.step, record.section

    callback.on_step_end(args, state, control)
    assert now() == (7, None)
    control.should_evaluate = control.should_save = True
    callback.on_step_end(args, state, control)
    assert now() == (7, "eval")
    callback.on_evaluate(args, state, control, metrics={})
    assert now() == (7, "checkpoint")
    callback.on_save(args, state, control)
    assert now() == (7, None)
    control.should_evaluate = control.should_save = False
    callback.on_prediction_step(args, state, control)
    assert now() == (7, "eval")
    callback.on_predict(args, state, control, metrics={})
    callback.on_train_end(args, state, control)
    assert now() == (7, "after-train")


# --- accounting, plot, alert, CLI ---------------------------------------------------------


def test_gpu_hours_add_up(tmp_path: Path) -> None:
    scenario = synth.fixture_scenarios()[0]
    trace = synth.generate(scenario)
    result = replay(trace, CONFIG)
    hours = result.accounting.gpu_hours()
    total = sum(hours.values()) * 3600
    assert total == pytest.approx(trace.duration_s * scenario.n_gpus, abs=2 * CONFIG.window_s)
    assert hours["compute"] > hours["communication"] > 0
    assert hours["checkpoint-or-deadlock"] * 3600 > 100  # the 90 s save and 45 s eval pause
    assert "compute" in result.accounting.table()
    out = plot_timeline(
        [s for t in trace.ticks for s in t.samples], result.windows, tmp_path / "t.png"
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    beats = [(t.t, t.heartbeat) for t in trace.ticks if t.heartbeat is not None]
    with_steps = plot_timeline([], result.windows, tmp_path / "s.png", heartbeats=beats)
    steps_only = plot_timeline([], [], tmp_path / "h.png", heartbeats=beats)  # no GPU data
    assert with_steps.read_bytes()[:4] == steps_only.read_bytes()[:4] == b"\x89PNG"


def test_accounting_uses_power_without_an_energy_counter() -> None:
    accounting = Accounting()
    accounting.add("compute", 10.0, energy_j=None, power_w=500.0)
    accounting.add(None, 5.0)
    assert accounting.energy_j["compute"] == 5000.0
    assert accounting.to_dict()["gpu_hours"]["unknown"] == pytest.approx(5 / 3600, abs=1e-6)


def test_alert_webhook_and_command(tmp_path: Path) -> None:
    received: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    out = tmp_path / "alert.txt"
    hook = AlertHook(
        webhook_url=f"http://127.0.0.1:{server.server_port}/hook",
        command=f'echo "$TUNELOOP_ALERT_REASON" > {out}',
    )
    send_alert(hook, {"reason": "deadlock: test", "last_step": 3})
    thread.join(5)
    server.server_close()
    assert received == [{"reason": "deadlock: test", "last_step": 3}]
    assert out.read_text().strip() == "deadlock: test"


def test_stacks_through_faulthandler_without_py_spy(tmp_path: Path) -> None:
    stderr = tmp_path / "rank.err"
    script = (
        "import time\n"
        "from tuneloop.telemetry.heartbeat import Heartbeat\n"
        f"hb = Heartbeat({str(tmp_path / 'hb.json')!r}, rank=0)\n"
        "hb.register_faulthandler()\n"
        "hb.beat(1)\n"
        "def waiting_in_a_collective():\n"
        "    time.sleep(60)\n"
        "waiting_in_a_collective()\n"
    )
    with stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], stderr=err)
        try:
            deadline = time.monotonic() + 30
            while not read_heartbeats(tmp_path / "hb.json") and time.monotonic() < deadline:
                time.sleep(0.1)
            records = read_heartbeats(tmp_path / "hb.json")
            assert records[0].stack_signal == signal.SIGUSR1
            how = dump_stacks([psutil.Process(proc.pid)], records, tmp_path / "s.txt", py_spy="")
            assert "faulthandler signal" in how
            assert proc.poll() is None  # the signal printed stacks; it did not kill
        finally:
            proc.kill()
            proc.wait()
    assert "waiting_in_a_collective" in stderr.read_text()


def test_watch_returns_the_commands_exit_code(tmp_path: Path) -> None:
    script = (
        "import os, sys; from tuneloop.telemetry.heartbeat import beat; "
        "[beat(i) for i in range(3)]; sys.exit(3)"
    )
    code = watch_main(
        ["--heartbeat-only", "--out-dir", str(tmp_path), "--", sys.executable, "-c", script]
    )
    assert code == 3
    manifest = json.loads((tmp_path / "watch.json").read_text())
    assert manifest["alarm"] is None and manifest["command_exit_code"] == 3
    assert manifest["calibration_source"] == "none"  # no GPU sampled, no power bands used
    assert read_heartbeats(tmp_path / "heartbeat.json")[0].step == 0  # throttled after one
    assert WATCHDOG_EXIT_CODE == 86


def test_watch_samples_a_replayed_trace_live(tmp_path: Path) -> None:
    trace_in = FIXTURES / "clean-long-checkpoint-h100.csv"
    script = (
        "import time; from tuneloop.telemetry.heartbeat import beat\n"
        "for i in range(12): beat(i); time.sleep(0.5)\n"
    )
    code = watch_main(
        [
            "--replay",
            str(trace_in),
            "--hz",
            "4",
            "--out-dir",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            script,
        ]
    )
    assert code == 0
    recorded = read_trace(tmp_path / "trace.csv")
    assert recorded.devices == read_trace(trace_in).devices
    assert recorded.ticks[-1].heartbeat is not None and recorded.ticks[-1].heartbeat.step
    manifest = json.loads((tmp_path / "watch.json").read_text())
    assert manifest["calibrations"]["0"] == {"gpu_model": "H100", "estimated": True}
    assert manifest["calibration_source"] == "estimate"
    assert manifest["accounting"]["total_gpu_hours"] > 0
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_watch_says_when_the_command_does_not_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = watch_main(["--heartbeat-only", "--out-dir", str(tmp_path), "--", "no-such-trainer"])
    assert code == 127
    assert "cannot start 'no-such-trainer'" in capsys.readouterr().err


def test_watch_needs_a_command() -> None:
    with pytest.raises(SystemExit):
        watch_main(["--deadlock-after", "5"])


HEAVY = ("torch", "transformers", "mlflow", "matplotlib", "numpy", "pandas", "pynvml")


@pytest.mark.parametrize(
    ("statement", "loaded"),
    [
        # The package roots import no submodule, so a stage depends only on what it imports.
        (
            "import tuneloop, tuneloop.telemetry, tuneloop.training",
            {"tuneloop", "tuneloop.telemetry", "tuneloop.training"},
        ),
        # A training script that only beats pays for the heartbeat, not the watcher.
        (
            "from tuneloop.telemetry.heartbeat import beat",
            {
                "tuneloop",
                "tuneloop.io",
                "tuneloop.telemetry",
                "tuneloop.telemetry.heartbeat",
                "tuneloop.telemetry.trace",
            },
        ),
    ],
    ids=["package-roots", "heartbeat"],
)
def test_imports_are_cheap(statement: str, loaded: set[str]) -> None:
    probe = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    modules = set(json.loads(done.stdout))
    assert {m for m in modules if m.split(".")[0] == "tuneloop"} == loaded
    assert not modules & set(HEAVY)

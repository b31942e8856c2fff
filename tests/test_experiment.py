"""Flow logic that needs no DVC run: experiment sets, values, a failed stage's message.

The flows end to end (retrain, and a sweep as DVC experiments) are in test_flow.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.experiment import check_sets, copy_paths, experiment_sets, override_text
from tests.helpers import ROOT, write_params
from tuneloop.params import load_params

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

PARAMS = ROOT / "params.yaml"


def test_a_pilot_sets_the_fraction_in_every_set() -> None:
    assert experiment_sets(None, 0.05) == [{"clean.pilot_fraction": 0.05}]
    sets = [{"train.learning_rate": 1e-4}, {"train.lora_r": 32}]
    assert experiment_sets(sets, 0.1) == [
        {"train.learning_rate": 1e-4, "clean.pilot_fraction": 0.1},
        {"train.lora_r": 32, "clean.pilot_fraction": 0.1},
    ]
    assert sets[0] == {"train.learning_rate": 1e-4}  # the caller's sets are left alone


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"train.learning_rte": 1e-4}, "'train.learning_rte' is not in params.yaml"),
        ({"trian.learning_rate": 1e-4}, "'trian' is not a params.yaml group"),
        ({"train.learning_rate": 5.0}, "train.learning_rate"),
        ({"clean.pilot_fraction": 0}, "clean.pilot_fraction"),
        ({"train.method": "lora-ish"}, "train.method"),
    ],
)
def test_a_bad_set_is_refused_before_anything_is_queued(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match="set 2") as refused:
        check_sets(PARAMS, [{"train.learning_rate": 1e-4}, settings])
    assert message in str(refused.value)


def test_good_sets_pass() -> None:
    check_sets(PARAMS, [{}, {"train.learning_rate": 2e-4, "train.phases": ["sft", "dpo"]}])


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1e-4, "0.0001"),
        (32, "32"),
        (True, "true"),
        (None, "null"),
        ("cosine", "cosine"),
        ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),
        ("two words", '"two words"'),
        (["sft", "dpo"], '["sft", "dpo"]'),
    ],
)
def test_values_are_written_as_dvc_reads_them(value: object, text: str) -> None:
    assert override_text(value) == text


def test_a_failed_stage_says_what_ended_it() -> None:
    from flows.retrain import failure_reason

    hung = {"tuneloop.watchdog.reason": "deadlock: no training step for 31 s", "x": "y"}
    assert failure_reason(hung) == "tuneloop.watchdog.reason: deadlock: no training step for 31 s"
    stopped = {"tuneloop.train.stop_rule": "max_wall_hours", "tuneloop.train.stop_reason": "12 h"}
    assert failure_reason(stopped) == "tuneloop.train.stop_reason: 12 h"
    assert failure_reason({"git.commit": "abc"}) is None


def test_a_queued_experiment_gets_every_out_dvc_does_not_cache(tmp_path: Path) -> None:
    # An out with `cache: false` that the temporary copy lacks reruns its stage (preflight's
    # reports missing made an experiment of evaluate's params train again). The copy gets the
    # metrics folder; only evaluate, the last stage, may keep other outs out of the cache.
    params = load_params(write_params(tmp_path))
    for folder in (params.paths.incoming, params.paths.metrics):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "dvc.lock").write_text("")
    expected = ["dvc.lock", str(params.paths.incoming), str(params.paths.metrics)]
    assert copy_paths(tmp_path, params) == expected
    for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        for out in [*(stage.get("outs") or []), *(stage.get("metrics") or [])]:
            if isinstance(out, dict):
                ((path, options),) = out.items()
                if options.get("cache") is False and name != "evaluate":
                    assert path.startswith("${paths.metrics}/"), (name, path)

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tuneloop.params import ParamsError, load_params, parse_params

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]


def shipped() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_shipped_params_load_and_derive() -> None:
    params = load_params(ROOT / "params.yaml")
    assert params.model.base == "builtin:tiny"
    assert params.train.resolved_lora_alpha == 2 * params.train.lora_r
    assert params.batch.gradient_accumulation_steps == params.batch.effective_batch // (
        params.batch.world_size * params.batch.micro_batch_size
    )


def test_params_are_frozen() -> None:
    params = load_params(ROOT / "params.yaml")
    with pytest.raises(ValueError):
        params.train.learning_rate = 1.0  # type: ignore[misc]


def test_unknown_key_is_rejected_by_name() -> None:
    data = shipped()
    data["train"]["learnig_rate"] = 1e-4
    with pytest.raises(ParamsError, match=r"train\.learnig_rate: unknown key"):
        parse_params(data)


def test_unknown_group_is_rejected() -> None:
    data = shipped()
    data["trian"] = {}
    with pytest.raises(ParamsError, match="trian: unknown key"):
        parse_params(data)


def test_wrong_value_names_the_key() -> None:
    data = shipped()
    data["clean"]["val_fraction"] = 0.9
    with pytest.raises(ParamsError, match=r"clean\.val_fraction"):
        parse_params(data)


def test_missing_key_is_named() -> None:
    data = shipped()
    del data["pack"]["seq_len"]
    with pytest.raises(ParamsError, match=r"pack\.seq_len: required key is missing"):
        parse_params(data)


def test_no_export_is_a_choice_but_an_fp8_rule_then_needs_its_export() -> None:
    data = shipped()
    data["export"]["formats"] = []
    with pytest.raises(ParamsError, match=r"gate\.fp8_max_drop is 0\.05, a rule on the FP8 export"):
        parse_params(data)
    data["gate"]["fp8_max_drop"] = None
    assert parse_params(data).export.formats == ()


def test_a_tasks_own_fp8_rule_needs_the_export_too() -> None:
    data = shipped()
    data["export"]["formats"] = []
    data["gate"]["fp8_max_drop"] = None
    data["tasks"]["support"]["gate"] = {"fp8_max_drop": 0.02}
    with pytest.raises(ParamsError, match=r"tasks\.support\.gate\.fp8_max_drop is 0\.02"):
        parse_params(data)


def test_batch_must_divide() -> None:
    data = shipped()
    data["batch"].update(world_size=2, micro_batch_size=2, effective_batch=6)
    with pytest.raises(ParamsError, match="effective_batch"):
        parse_params(data)


@pytest.mark.parametrize(
    ("watch", "inside"),
    [("checkpoints/train/watch", "checkpoints"), ("models/adapter/w", "adapter")],
)
def test_watchdog_evidence_stays_out_of_what_runs_replace(watch: str, inside: str) -> None:
    data = shipped()
    data["paths"]["watch"] = watch
    with pytest.raises(ParamsError, match=rf"paths\.watch .*inside paths\.{inside}"):
        parse_params(data)
    data["paths"]["watch"] = "reports/watch"
    assert parse_params(data).paths.watch == Path("reports/watch")


def test_unknown_builtin_model() -> None:
    data = shipped()
    data["model"]["base"] = "builtin:huge"
    with pytest.raises(ParamsError, match="builtin:tiny"):
        parse_params(data)


def test_bad_yaml_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text("train: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(path)

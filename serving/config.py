"""Typed, frozen configuration of the canary router (``RouterConfig``).

Loaded once, from a YAML file or a dict; unknown keys are an error so a typo
never falls back to a default silently.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tuneloop.release import ARMS


class RouterConfigError(ValueError):
    """The router config is missing, malformed or holds a wrong value; the message names the key."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArmConfig(_Frozen):
    """One OpenAI-compatible backend (a vLLM or ``transformers serve`` endpoint)."""

    base_url: str = Field(
        min_length=1, description="backend root, e.g. http://127.0.0.1:8001 (no /v1)"
    )
    model: str = Field(min_length=1, description="the model name the backend serves")
    model_version: str = Field(min_length=1, description="registry version, written to badcases")


class Timeouts(_Frozen):
    """Seconds; ``read`` is the longest gap between two bytes, so it bounds a stalled stream."""

    connect: float = Field(default=2.0, gt=0)
    read: float = Field(default=120.0, gt=0)
    write: float = Field(default=10.0, gt=0)
    pool: float = Field(default=5.0, gt=0, description="wait for a free pooled connection")


class RouterConfig(_Frozen):
    public_model: str = Field(
        default="tuneloop", min_length=1, description="the model name clients ask for"
    )
    arms: dict[str, ArmConfig] = Field(description="exactly 'champion' and 'challenger'")
    challenger_percent: int = Field(
        default=0, ge=0, le=100, description="share of user buckets sent to the challenger"
    )
    timeouts: Timeouts = Timeouts()
    max_connections_per_arm: int = Field(default=200, ge=1)
    feedback_dir: Path = Field(description="where router-feedback-YYYY-MM-DD.jsonl files land")
    admin_token_env: str = Field(default="TUNELOOP_ADMIN_TOKEN", min_length=1)
    state_file: Path | None = Field(
        default=None,
        description="where admin weight changes are kept so a restart does not undo a rollback",
    )
    stats_window: int = Field(
        default=2048, ge=10, description="recent requests per arm that percentiles are taken over"
    )
    served_records: int = Field(
        default=100_000,
        ge=1,
        description="request ids and users whose serving arm is remembered for feedback",
    )

    @model_validator(mode="after")
    def _two_arms(self) -> RouterConfig:
        if sorted(self.arms) != sorted(ARMS):
            raise ValueError(
                f"arms must be exactly {list(ARMS)} (got {sorted(self.arms)}); "
                "the release flow moves traffic between these two names"
            )
        return self


def load_router_config(path: Path) -> RouterConfig:
    """Read and validate a router config file, naming the bad key on failure."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RouterConfigError(f"{path} not found") from None
    except yaml.YAMLError as error:
        raise RouterConfigError(f"{path} is not valid YAML: {error}") from None
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as error:
        lines = [f"{path}: {error.error_count()} invalid value(s):"]
        for item in error.errors():
            key = ".".join(str(part) for part in item["loc"])
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
        raise RouterConfigError("\n".join(lines)) from None

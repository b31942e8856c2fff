"""Typed, frozen configuration of the canary router (``RouterConfig``).

Loaded once, from a YAML file or a dict; unknown keys are an error so a typo
never falls back to a default silently.

An arm is either written out (``base_url``, ``model``, ``model_version``) or named by
the registry alias it serves, ``{alias: champion}``: then it is what ``tuneloop serve
champion`` recorded in ``serve_dir`` when it started the backend (its URL, model name and
the version it actually serves).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tuneloop.release import ARMS
from tuneloop.release.serve import SERVE_DIR, NotServable, read_record


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


class FeedbackProducer(_Frozen):
    """A tool allowed to flag responses (a support tool, a labelling UI), with its own token."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="recorded on every line it writes as the tag tuneloop.feedback.source=<name>",
    )
    token_env: str = Field(min_length=1, description="env var holding this producer's token")
    rate_per_minute: float = Field(default=60.0, gt=0, description="sustained flags per minute")
    burst: int = Field(default=20, ge=1, description="flags it may send at once above the rate")


class Limits(_Frozen):
    """Sizes checked before anything is parsed or written; over a limit is a 413."""

    request_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="a proxied completion request body"
    )
    feedback_bytes: int = Field(default=256 * 1024, ge=1024, description="a /v1/feedback body")
    admin_bytes: int = Field(default=16 * 1024, ge=256, description="an /admin/* body")
    json_depth: int = Field(default=32, ge=4, description="nesting of arrays and objects")
    text_chars: int = Field(
        default=32 * 1024, ge=1, description="one message, bad or corrected response in a flag"
    )
    messages: int = Field(default=64, ge=1, description="turns in a flagged conversation")
    tags: int = Field(default=16, ge=0, description="tags on a flag")
    tag_chars: int = Field(default=100, ge=1, description="one tag")
    line_bytes: int = Field(
        default=1_000_000,
        ge=1024,
        description="a written feedback line, at most ingest.max_line_bytes so ingest accepts it",
    )

    @model_validator(mode="after")
    def _a_field_fits_a_line(self) -> Limits:
        # json.dumps writes a control character as 6 bytes (\u001f): the worst case per char.
        if self.text_chars * 6 >= self.line_bytes:
            raise ValueError(
                f"limits.text_chars ({self.text_chars}) x 6 bytes must stay below "
                f"limits.line_bytes ({self.line_bytes}); lower text_chars"
            )
        return self


class ShadowConfig(_Frozen):
    """Mirroring to the challenger during a release's shadow step (set by ``/admin/shadow``)."""

    memory: int = Field(
        default=10_000, ge=10, description="answer pairs kept for the analysis (GET /admin/shadow)"
    )
    text_chars: int = Field(
        default=4096, ge=64, description="each answer's text kept for scoring, at most"
    )
    concurrency: int = Field(
        default=32,
        ge=1,
        description="mirrored requests in flight at once; beyond it a request is not mirrored, "
        "so a slow challenger never queues up work for nobody",
    )


class RouterConfig(_Frozen):
    serve_dir: Path = Field(
        default=SERVE_DIR, description="where `tuneloop serve` records what it serves (alias arms)"
    )
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
    sample_memory: int = Field(
        default=50_000,
        ge=100,
        description="finished requests kept for the release's analysis (GET /admin/samples); "
        "an analysis interval's traffic on all arms must fit, or its oldest requests are lost",
    )
    shadow: ShadowConfig = ShadowConfig()
    feedback_producers: tuple[FeedbackProducer, ...] = Field(
        default=(), description="who may POST /v1/feedback; none configured: nobody may"
    )
    request_id_secret_env: str = Field(
        default="TUNELOOP_ROUTER_SECRET",
        min_length=1,
        description="env var holding the key that signs X-Request-Id (the same on every replica)",
    )
    request_id_scope: str = Field(
        default="",
        max_length=100,
        description="set per task by a router that serves several (serving.tasks): an id one "
        "task issued is no id of another's, so a flag can never be charged across tasks",
    )
    request_id_max_age_s: int = Field(
        default=30 * 24 * 3600, ge=60, description="older request ids attribute no flag"
    )
    flag_memory: int = Field(
        default=100_000,
        ge=1,
        description="flagged request ids (a second flag attributes nothing) and flagged users "
        "per arm the router remembers",
    )
    limits: Limits = Limits()

    @model_validator(mode="before")
    @classmethod
    def _alias_arms(cls, data: object) -> object:
        if not isinstance(data, dict) or not isinstance(data.get("arms"), dict):
            return data
        serve_dir = Path(data.get("serve_dir") or SERVE_DIR)
        arms = dict(data["arms"])
        for arm, given in arms.items():
            if isinstance(given, dict) and set(given) == {"alias"}:
                try:
                    arms[arm] = read_record(str(given["alias"]), serve_dir).arm()
                except NotServable as error:
                    raise ValueError(f"arms.{arm}: {error}") from None
        return {**data, "arms": arms}

    @model_validator(mode="after")
    def _two_arms(self) -> RouterConfig:
        if sorted(self.arms) != sorted(ARMS):
            raise ValueError(
                f"arms must be exactly {list(ARMS)} (got {sorted(self.arms)}); "
                "the release flow moves traffic between these two names"
            )
        return self

    @model_validator(mode="after")
    def _producers_apart(self) -> RouterConfig:
        names = [p.name for p in self.feedback_producers]
        envs = [p.token_env for p in self.feedback_producers]
        for what, values in (("name", names), ("token_env", envs)):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(f"feedback_producers: {what} used twice: {twice}")
        shared = {self.admin_token_env, self.request_id_secret_env} & set(envs)
        if shared or self.admin_token_env == self.request_id_secret_env:
            raise ValueError(
                f"feedback_producers, admin_token_env and request_id_secret_env must name "
                f"different variables (shared: {sorted(shared) or [self.admin_token_env]}): "
                "a producer's token must never open the admin API or sign request ids"
            )
        return self


def read_config_file(path: Path) -> object:
    """A router config file's YAML, or ``RouterConfigError`` saying why it cannot be read."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RouterConfigError(f"{path} not found") from None
    except yaml.YAMLError as error:
        raise RouterConfigError(f"{path} is not valid YAML: {error}") from None


def router_config(data: object, where: str) -> RouterConfig:
    """Validate one router's config, naming each bad key after ``where`` on failure."""
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as error:
        lines = [f"{where}: {error.error_count()} invalid value(s):"]
        for item in error.errors():
            key = ".".join(str(part) for part in item["loc"])
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
        raise RouterConfigError("\n".join(lines)) from None


def load_router_config(path: Path) -> RouterConfig:
    """Read and validate a router config file, naming the bad key on failure."""
    return router_config(read_config_file(path), str(path))

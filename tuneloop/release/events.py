"""The steps of a release, in order: what ``ReleaseOutcome.history`` holds and the demo prints.

One model per kind, told apart by ``kind`` (a pydantic discriminated union), so a reader
matches on the class and reads fields that mypy knows, and the JSON keeps the shape it had
as plain dicts (``{"kind": "shift", "percent": 10}``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tuneloop.release.approval import Approval


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    percent: int = Field(description="the challenger's share of traffic (or mirrored) then")


class Shift(_Event):
    """The router's weight moved: the challenger now answers ``percent`` % of requests."""

    kind: Literal["shift"] = "shift"


class Shadow(_Event):
    """``percent`` % of users mirrored to the challenger, whose answers nobody sees."""

    kind: Literal["shadow"] = "shadow"


class Analysis(_Event):
    """One interval judged: the challenger's requests against the champion's."""

    kind: Literal["analysis", "shadow_analysis"]
    passed: bool
    outcome: str = Field(description="pass, fail or inconclusive")
    extended: bool = Field(description="inconclusive, and the interval was extended")
    challenger_share: float | None = Field(
        default=None, description="share of the interval's requests the challenger answered"
    )
    requests: dict[str, int] | None = Field(
        default=None, description="the interval's requests, by arm (champion, challenger)"
    )


class ApprovalStep(Approval):
    """A person's answer to the approval form (``Approval``, as the flow validated it) at
    ``percent`` %."""

    kind: Literal["approval"] = "approval"
    percent: int = Field(description="the challenger's share of traffic when it was asked")


class Rollback(BaseModel):
    """The challenger taken to 0 % on every router, and how long that took."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["rollback"] = "rollback"
    reason: str
    seconds: float


ReleaseEvent = Annotated[
    Shift | Shadow | Analysis | ApprovalStep | Rollback, Field(discriminator="kind")
]

"""What people say before and during a release: the blind review and the gate's unsettled rules.

- ``review_name``: the review of a candidate version, as the release and the demo name it.
- ``ensure_review``: that review, created from the candidate run's ``evaluation/review-items.jsonl``
  (both answers to every business item, written by the evaluate stage) when the store has none.
- ``judge_review``: its results now (``tuneloop.review.tally``) and, with ``gate.blind_review``
  set, the rule's check (``tuneloop.judge.gate.review_check``).
- ``record_review``: the results on the candidate's MLflow run (``review.*`` metrics, the table
  ``review/results.md``, the plot ``review/results.png``, the JSON), in its model card (the
  run's ``evaluation/model-card.md``, with a section appended) and as a tag on the model version
  (``review.result``), which ``tuneloop status`` shows.
- ``form_section``: what the approval form says about both.

Without ``gate.blind_review`` the review is reported and never blocks; with it, the release
waits for it before the first traffic (``flows/release.py``).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tuneloop.io import read_jsonl
from tuneloop.judge import cards
from tuneloop.judge.decision import Check, Decision
from tuneloop.judge.gate import review_check
from tuneloop.judge.verdict import INCONCLUSIVE
from tuneloop.params import GateParams
from tuneloop.review.store import ReviewError, ReviewItem, ReviewStore, create_review, review_info
from tuneloop.review.tally import ReviewResults, compute_results
from tuneloop.tracking.registry import unsettled_of

log = logging.getLogger(__name__)

REVIEW_ITEMS_ARTIFACT = "evaluation/review-items.jsonl"
# Which champion the candidate was evaluated against (``registry.describe``).
DECISION_ARTIFACT = "evaluation/decision.json"
CARD_ARTIFACT = "evaluation/model-card.md"
TAG_REVIEW = "review.result"  # on the model version: one line for `tuneloop status`


class ReviewUnavailable(RuntimeError):
    """No review can be made for this candidate; the message names the fix."""


def review_name(model: str, version: str) -> str:
    return f"{model}-v{version}"


def label(version: ModelVersion) -> str:
    """A model version as a review names it: ``<model> v<version>``."""
    return f"{version.name} v{version.version}"


def existing_review(
    store: ReviewStore, candidate: ModelVersion, champion: ModelVersion
) -> str | None:
    """``candidate``'s review if the store has one, None if not; ``ReviewUnavailable`` when it
    judges the candidate against another champion than ``champion``.

    A review is found by the candidate's name and version, but its votes are about the pair it
    showed: reused against a champion that moved since, they would be counted for a comparison
    no reviewer saw. A label a person wrote otherwise (``tuneloop review create``) is theirs to
    vouch for.
    """
    name = review_name(candidate.name, str(candidate.version))
    try:
        info = review_info(store, name)
    except ReviewError:
        return None
    for role, expected in (("champion", champion), ("candidate", candidate)):
        shown = re.fullmatch(rf"{re.escape(expected.name)} v(\d+)", str(info[role]))
        if shown is not None and shown.group(1) != str(expected.version):
            raise ReviewUnavailable(
                f"review {name!r} compares {info['candidate']} with {info['champion']}, but this "
                f"release compares {label(candidate)} with {label(champion)}: its votes are about "
                f"another pair. Create a review of this pair by hand under another name, or "
                "evaluate and register the candidate again"
            )
    return name


def compared_with(decision: Decision, candidate: ModelVersion, champion: ModelVersion) -> None:
    """The candidate's evaluated answers sit beside ``champion``'s: its ``decision.json``
    compared it with that version; ``ReviewUnavailable`` otherwise."""
    evaluated = None if decision.champion is None else decision.champion.version
    if str(evaluated) != str(champion.version):
        raise ReviewUnavailable(
            f"{label(candidate)} was evaluated against champion v{evaluated}, but the champion "
            f"is {label(champion)} now: its answers for a blind review sit beside another "
            "model's. Run `dvc repro --force --single-item evaluate@<task>` and register it again"
        )


def ensure_review(
    store: ReviewStore, client: MlflowClient, candidate: ModelVersion, champion: ModelVersion
) -> str:
    """The name of ``candidate``'s review, created from its run's artifact if the store has none."""
    found = existing_review(store, candidate, champion)
    if found is not None:
        return found
    name = review_name(candidate.name, str(candidate.version))
    if not candidate.run_id:
        raise ReviewUnavailable(
            f"{candidate.name} v{candidate.version} has no source run, so no answers to review: "
            "create the review by hand (`tuneloop review create ...`) named " + repr(name)
        )
    with tempfile.TemporaryDirectory(prefix="tuneloop-review-") as tmp:
        try:
            path = client.download_artifacts(candidate.run_id, REVIEW_ITEMS_ARTIFACT, tmp)
            decision = client.download_artifacts(candidate.run_id, DECISION_ARTIFACT, tmp)
        except (MlflowException, OSError) as error:
            raise ReviewUnavailable(
                f"{candidate.name} v{candidate.version}'s run has no {REVIEW_ITEMS_ARTIFACT} (an "
                f"evaluate from before the blind review wrote none: {error}); rerun `dvc repro "
                f"evaluate` and register again, or create review {name!r} by hand"
            ) from None
        compared_with(Decision.read(Path(decision)), candidate, champion)
        records = list(read_jsonl(Path(path)))
    if not records:
        raise ReviewUnavailable(
            f"{REVIEW_ITEMS_ARTIFACT} of {candidate.name} v{candidate.version} is empty (no "
            "champion was scored beside it): nothing to compare blind"
        )
    items = [ReviewItem.from_record(r) for r in records]
    create_review(store, name, items, champion=label(champion), candidate=label(candidate))
    log.info("review %s created: %d items", name, len(items))
    return name


@dataclass(frozen=True)
class ReviewJudgement:
    results: ReviewResults
    check: Check | None  # None without gate.blind_review: reported, never blocking

    def summary(self) -> str:
        o = self.results.overall
        decisive = (
            "no decisive vote"
            if o.decisive.value is None
            else f"win rate of decisive votes {o.decisive.value:.0%} "
            f"[{o.decisive.low:.0%}, {o.decisive.high:.0%}]"
        )
        counts = (
            f"{o.win.count} wins, {o.tie.count} ties, {o.loss.count} losses, "
            f"{o.both_wrong.count} both wrong"
        )
        status = (
            "reported, not a rule (gate.blind_review unset)"
            if self.check is None
            else self.check.status.upper()
        )
        return (
            f"blind review {self.results.review}: {self.results.votes} votes by "
            f"{len(self.results.reviewers)} reviewers ({counts}); {decisive}: {status}"
        )


def judge_review(store: ReviewStore, name: str, gate: GateParams) -> ReviewJudgement:
    results = compute_results(store, name, confidence=gate.confidence)
    check = review_check(results.as_dict(), gate) if gate.blind_review is not None else None
    return ReviewJudgement(results, check)


def plot(results: ReviewResults, path: Path) -> None:
    """Win, tie, loss and both-wrong shares by slice, stacked, one bar per slice."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [results.overall, *results.slices]
    labels = ["all" if s.key == "all" else f"{s.key}={s.value}" for s in rows]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows)), 3.5))
    bottom = [0.0] * len(rows)
    for name, color in (
        ("win", "#2a9d8f"),
        ("tie", "#bdbdbd"),
        ("loss", "#e76f51"),
        ("both_wrong", "#6d597a"),
    ):
        shares = [getattr(s, name).value or 0.0 for s in rows]
        ax.bar(labels, shares, bottom=bottom, label=name.replace("_", " "), color=color)
        bottom = [b + v for b, v in zip(bottom, shares, strict=True)]
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of votes")
    ax.set_title(f"{results.candidate} vs {results.champion}: {results.votes} votes")
    ax.legend(loc="upper right", fontsize="small")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def record_review(
    client: MlflowClient, run_id: str, judged: ReviewJudgement, version: ModelVersion | None = None
) -> None:
    """The review's results on the candidate's run, in its model card and on its version."""
    results = judged.results
    for key, value in results.metrics("review").items():
        client.log_metric(run_id, key, value)
    if judged.check is not None:
        client.set_tag(run_id, "review.status", judged.check.status)
    with tempfile.TemporaryDirectory(prefix="tuneloop-review-") as tmp:
        folder = Path(tmp) / "review"
        folder.mkdir()
        (folder / "results.md").write_text(results.table() + "\n", encoding="utf-8")
        (folder / "results.json").write_text(
            json.dumps(
                {
                    **results.as_dict(),
                    "check": None if judged.check is None else judged.check.model_dump(),
                },
                indent=2,
                ensure_ascii=False,
            ),
            encoding="utf-8",
        )
        plot(results, folder / "results.png")
        client.log_artifacts(run_id, str(folder), "review")
        card = _card_with_review(client, run_id, judged, Path(tmp))
        if card is not None:
            client.log_artifact(run_id, str(card), "evaluation")
    if version is not None:
        client.set_model_version_tag(
            version.name, str(version.version), TAG_REVIEW, judged.summary()[:5000]
        )


def _card_with_review(
    client: MlflowClient, run_id: str, judged: ReviewJudgement, tmp: Path
) -> Path | None:
    """The run's model card with the review's section (replacing an earlier one)."""
    try:
        path = Path(client.download_artifacts(run_id, CARD_ARTIFACT, str(tmp / "card")))
    except (MlflowException, OSError) as error:
        log.warning("no %s on run %s to add the review to: %s", CARD_ARTIFACT, run_id, error)
        return None
    text = path.read_text(encoding="utf-8")
    section = cards.review_section(judged.results.table(), judged.summary())
    out = tmp / "model-card.md"
    out.write_text(cards.with_review_section(text, section), encoding="utf-8")
    return out


def unsettled_rules(candidate: ModelVersion, judged: ReviewJudgement | None) -> tuple[str, ...]:
    """Every rule let through unsettled: the gate's (on the version's tags) and the review's."""
    found = tuple(unsettled_of(candidate))
    check = judged.check if judged is not None else None
    if check is not None and check.status == INCONCLUSIVE and not check.blocking:
        found += (check.reason,)
    return found


def form_section(judged: ReviewJudgement | None, unsettled: list[str]) -> str:
    """The approval form's lines on the review and on what the gate could not settle."""
    parts = []
    if judged is None:
        parts.append("Blind review: none for this candidate (`tuneloop review` starts one).")
    else:
        parts.append(f"Blind review: {judged.summary()}.\n\n{judged.results.table()}")
    if unsettled:
        listed = "\n".join(f"- {line}" for line in unsettled)
        parts.append(
            f"**The gate could not settle {len(unsettled)} rule(s)** and let the candidate "
            f"through (gate.on_inconclusive: warn):\n\n{listed}\n\nTick "
            "`acknowledge_inconclusive` to approve: an approval without it is refused."
        )
    return "\n\n".join(parts)

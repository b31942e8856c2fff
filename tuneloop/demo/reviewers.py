"""The demo's review panel: three made-up reviewers who vote blind through the page's HTTP API.

Each reviewer opens their invitation link, then asks ``GET /review/next.json`` for their next
item and answers ``POST /review/vote`` (``Accept: application/json``), exactly the calls the
page's own form makes: the store, the one-time nonces and the refusals are the real ones.

Their taste is made up, and stated: a reviewer prefers the answer the business suite marks
right (the suite's own reference, compared the way its ``accuracy`` is, with the project's
one text normaliser), calls it a tie when both are right and "both wrong" when neither is;
with their own share of noise they pick any of the four instead. They never learn which
answer is whose: the page does not say, and they judge only the text in front of them.
Seeded per reviewer, so a demo run votes the same way again.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from tuneloop.data.text import normalise
from tuneloop.review.store import CHOICES, ReviewStore, create_invite

log = logging.getLogger(__name__)

JSON = {"Accept": "application/json"}


@dataclass(frozen=True)
class Reviewer:
    name: str
    noise: float  # share of votes picked at random from the four choices


PANEL = (Reviewer("ana", 0.10), Reviewer("bo", 0.15), Reviewer("chen", 0.20))


def references(suite_file: Path) -> dict[str, str]:
    """The business suite's right answer of each question, keyed by the normalised question."""
    found = {}
    for line in suite_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            found[normalise(record["question"])] = str(record["answer"])
    return found


def choose(
    question: str, answer_a: str, answer_b: str, refs: Mapping[str, str], rng: random.Random,
    noise: float,
) -> str:  # fmt: skip
    """What a reviewer of this taste answers: a, b, tie or both_wrong."""
    if rng.random() < noise:
        return rng.choice(CHOICES)
    reference = refs.get(normalise(question))
    right_a = reference is not None and normalise(answer_a) == normalise(reference)
    right_b = reference is not None and normalise(answer_b) == normalise(reference)
    if right_a and right_b:
        return "tie"
    if right_a or right_b:
        return "a" if right_a else "b"
    return "both_wrong"


def vote_through_the_page(
    client: httpx.Client, link: str, reviewer: Reviewer, refs: Mapping[str, str], seed: int
) -> int:
    """One reviewer's whole review through the HTTP API (``client``: this reviewer's own, so
    its cookie is theirs): how many votes were recorded."""
    rng = random.Random(f"{seed}/{reviewer.name}")
    voted = 0
    opened = client.get(link, follow_redirects=True)  # the invitation sets the cookie
    opened.raise_for_status()
    while True:
        page = client.get("/review/next.json", headers=JSON)
        page.raise_for_status()
        item = page.json()
        if item["done"]:
            return voted
        choice = choose(
            item["question"], item["answer_a"], item["answer_b"], refs, rng, reviewer.noise
        )
        answer = client.post(
            "/review/vote",
            data={"item": item["item"], "nonce": item["nonce"], "choice": choice},
            headers=JSON,
        )
        if answer.status_code != 200:
            raise RuntimeError(
                f"the review page refused {reviewer.name}'s vote ({answer.status_code}): "
                f"{answer.text[:300]}"
            )
        voted += 1


def run_panel(
    store: ReviewStore, review: str, base_url: str, refs: Mapping[str, str], seed: int
) -> dict[str, int]:
    """Invite the panel to ``review`` on the page at ``base_url``; each reviewer's votes."""
    cast = {}
    for reviewer in PANEL:
        invite = create_invite(store, reviewer.name, review=review, base_url=base_url)
        with httpx.Client(base_url=base_url, timeout=30) as client:
            cast[reviewer.name] = vote_through_the_page(client, invite.link, reviewer, refs, seed)
        log.info("review %s: %s cast %d votes", review, reviewer.name, cast[reviewer.name])
    return cast

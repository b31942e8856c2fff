"""What the blind review's tests share: items in two languages, model names to look for."""

from __future__ import annotations

from pathlib import Path

from tuneloop.review.store import ReviewItem, ReviewStore

# The two models' names as the store keeps them: no response a reviewer gets may hold them.
CHAMPION, CANDIDATE = "support-v3", "support-v4-rc1"
NAMES = ("champion", "candidate", CHAMPION, CANDIDATE)

HOSTILE = (
    "<script>document.title='pwned'</script>"
    "<img src=x onerror=\"document.title='pwned'\">"
    "</div></section><b>bold?</b>"
)

QUESTIONS = (
    ("How do I get a refund?", "refund", "en"),
    ("我的订单什么时候到？", "order_status", "zh"),
    ("Can I change my delivery address?", "order_status", "en"),
    ("如何申请退款？", "refund", "zh"),
    ("Where is my invoice?", "billing", "en"),
    ("发票在哪里下载？", "billing", "zh"),
)


def review_items(n: int = 6, hostile: bool = False) -> list[ReviewItem]:
    """``n`` items over two intents and two languages; the candidate's answers say "new"."""
    found = []
    for i in range(n):
        question, intent, language = QUESTIONS[i % len(QUESTIONS)]
        found.append(
            ReviewItem(
                question=f"{question} (#{i})",
                champion_answer=f"Old answer {i}: 请稍候。",
                candidate_answer=(HOSTILE if hostile else "") + f"New answer {i}: 马上为您处理。",
                slices={"intent": intent, "language": language},
                ref=f"support_demo/{i}",
            )
        )
    return found


def sqlite_store(folder: Path) -> ReviewStore:
    return ReviewStore(f"sqlite:///{folder / 'review.db'}")

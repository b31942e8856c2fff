"""The HTML a reviewer sees: one item with two answers, the four choices, progress.

Every text that comes from a model, a question or a reviewer goes through ``escape``: an
answer holding ``<script>`` shows those characters, and nothing runs. The page's one script
(the keyboard shortcuts) carries the response's CSP nonce, so even an answer that escaped
escaping could not run one. Nothing here names either model: the answers are "A" and "B".
The labels are English; questions and answers carry their item's ``lang`` and a font list
that covers Chinese, Japanese and Korean.
"""

from __future__ import annotations

import html
import re

from tuneloop.review.store import Page

# A BCP 47 tag's shape ("en", "zh", "zh-Hans"): anything else is left out of the lang attribute.
LANG_TAG = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8}){0,3}$")

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans",
  "Noto Sans CJK SC", "PingFang SC", "Hiragino Sans GB", "Microsoft YaHei", sans-serif;
  margin: 0 auto; max-width: 72rem; padding: 1rem 1.5rem; color: #1d1d1f; line-height: 1.5; }
header { display: flex; align-items: baseline; gap: 1.5rem; }
h1 { font-size: 1.2rem; margin: 0; }
h2 { font-size: 0.95rem; margin: 0 0 0.4rem; color: #555; }
progress { width: 12rem; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; }
.question { background: #f4f4f6; border-radius: 6px; padding: 0.8rem 1rem; margin: 1rem 0; }
.answers { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
.answer { border: 1px solid #ccc; border-radius: 6px; padding: 0.8rem 1rem; }
.choices { display: flex; flex-wrap: wrap; gap: 0.6rem; margin: 1rem 0; }
button { font-size: 1rem; padding: 0.5rem 1rem; cursor: pointer; }
kbd { border: 1px solid #999; border-radius: 3px; padding: 0 0.3rem; font-size: 0.8rem; }
textarea { width: 100%; min-height: 3rem; font: inherit; }
.keys, .note { color: #666; font-size: 0.85rem; }
@media (max-width: 50rem) { .answers { grid-template-columns: 1fr; } }
"""

# 1/2/3/4 or a/b/t/w vote; typing in the comment box is left alone; a second key press while
# the first vote is on its way sends nothing (the server would refuse it as a replay anyway).
SCRIPT = """
(function () {
  var form = document.getElementById('vote');
  var sent = false;
  form.addEventListener('submit', function (event) {
    if (sent) { event.preventDefault(); }
    sent = true;
  });
  var keys = {'1': 'a', 'a': 'a', '2': 'b', 'b': 'b', '3': 'tie', 't': 'tie',
              '4': 'both_wrong', 'w': 'both_wrong'};
  document.addEventListener('keydown', function (event) {
    var target = event.target;
    if (event.ctrlKey || event.metaKey || event.altKey) { return; }
    if (target && (target.tagName === 'TEXTAREA' || target.tagName === 'INPUT')) { return; }
    var choice = keys[(event.key || '').toLowerCase()];
    if (!choice) { return; }
    event.preventDefault();
    document.getElementById('choice-' + choice).click();
  });
})();
"""

BUTTONS = (
    ("a", "A is better", "1"),
    ("b", "B is better", "2"),
    ("tie", "Tie", "3"),
    ("both_wrong", "Both wrong", "4"),
)


def escape(text: str) -> str:
    return html.escape(text, quote=True)


def lang_attribute(language: str | None) -> str:
    return f' lang="{escape(language)}"' if language and LANG_TAG.match(language) else ""


def document(title: str, body: str, script_nonce: str | None = None) -> str:
    script = f'<script nonce="{escape(script_nonce)}">{SCRIPT}</script>' if script_nonce else ""
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="referrer" content="no-referrer">\n'
        f"<title>{escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n"
        f"<body>\n{body}\n{script}\n</body>\n</html>\n"
    )


def item_page(page: Page, script_nonce: str, max_comment: int) -> str:
    """The page for one item: question, answers A and B, the form with its one-time nonce."""
    lang = lang_attribute(page.language)
    buttons = "\n".join(
        f'<button type="submit" name="choice" value="{value}" id="choice-{value}">'
        f"{label} <kbd>{key}</kbd></button>"
        for value, label, key in BUTTONS
    )
    body = f"""<header>
<h1>Blind review</h1>
<p class="progress" id="progress">Item <b>{page.number}</b> of <b>{page.total}</b></p>
<progress value="{page.number - 1}" max="{page.total}"></progress>
</header>
<main>
<section class="question">
<h2>Question</h2>
<div class="text" id="question"{lang}>{escape(page.question)}</div>
</section>
<div class="answers">
<section class="answer">
<h2>Answer A</h2>
<div class="text" id="answer-a"{lang}>{escape(page.answer_a)}</div>
</section>
<section class="answer">
<h2>Answer B</h2>
<div class="text" id="answer-b"{lang}>{escape(page.answer_b)}</div>
</section>
</div>
<form method="post" action="/review/vote" id="vote">
<input type="hidden" name="item" value="{escape(page.key)}">
<input type="hidden" name="nonce" value="{escape(page.nonce)}">
<div class="choices">
{buttons}
</div>
<label for="comment" class="note">Comment (optional, up to {max_comment} characters)</label>
<textarea id="comment" name="comment" maxlength="{max_comment}"></textarea>
</form>
<p class="keys">Keys: <kbd>1</kbd> or <kbd>A</kbd> A is better, <kbd>2</kbd> or <kbd>B</kbd>
B is better, <kbd>3</kbd> or <kbd>T</kbd> tie, <kbd>4</kbd> or <kbd>W</kbd> both wrong
(outside the comment box). The two answers come in a random order.</p>
</main>"""
    return document(f"Blind review: item {page.number} of {page.total}", body, script_nonce)


def done_page(done: int, total: int) -> str:
    body = f"""<header><h1>Blind review</h1>
<p class="progress" id="progress">Item <b>{done}</b> of <b>{total}</b></p></header>
<main><p id="done">All done: {done} of {total} items judged. Thank you.</p></main>"""
    return document("Blind review: done", body)


def message_page(status: int, reason: str) -> str:
    body = f"""<header><h1>Blind review</h1></header>
<main><p id="refused">{escape(reason)}</p>
<p class="note">({status}) <a href="/review">Back to the review</a></p></main>"""
    return document("Blind review", body)

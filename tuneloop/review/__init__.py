"""Blind review by people: a candidate's answers beside the champion's, judged without names.

=============  ==============================================================================
module         what it holds
=============  ==============================================================================
``store``      the votes' database (SQLite by default, PostgreSQL through a URL): reviews and
               their items, reviewers by invitation, each reviewer's plan, one-time forms,
               votes; ``create_review``, ``create_invite``, ``revoke``, ``record_vote``
``tally``      the results: win, tie and loss rates with Wilson intervals by slice, agreement
               between reviewers, each reviewer's consistency on control items
``page``       the HTML a reviewer sees (every answer escaped; no model is ever named)
``web``        the FastAPI app that serves it: invitation links, the page, the vote
=============  ==============================================================================

The gate, the release and the demo call ``store.create_review`` and ``tally.compute_results``;
``tuneloop review`` (``tuneloop/cli/review.py``) is the command line.
"""

"""The release: its controller, the canary analysis, approvals, the routers' admin client, the
load test, backends.

The analysis in three parts: what is read from the routers (``readings``), the tests
of one figure against the champion's (``checks``, on ``tuneloop.judge.stats``) and the
verdicts they add up to (``analysis``), in the shared vocabulary of
``tuneloop.judge.verdict``.

Everything the release flow (``flows/release.py``) and the ``tuneloop``
approve/reject/status commands use to move a model into traffic. The router
server itself lives in ``serving/``; this package talks to it over HTTP only and
never imports it.

Importing the package root is cheap: modules are imported where they are used.
"""

# The two arm names the router serves and the release moves traffic between.
ARMS = ("champion", "challenger")

"""The release: canary analysis, approvals, the routers' admin client, the load test, backends.

Everything the release flow (``flows/release.py``) and the ``tuneloop``
approve/reject/status commands use to move a model into traffic. The router
server itself lives in ``serving/``; this package talks to it over HTTP only and
never imports it.

Importing the package root is cheap: modules are imported where they are used.
"""

# The two arm names the router serves and the release moves traffic between.
ARMS = ("champion", "challenger")

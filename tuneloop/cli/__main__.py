"""``python -m tuneloop.cli``: the ``tuneloop`` command without its console script."""

import sys

from tuneloop.cli import main

sys.exit(main())

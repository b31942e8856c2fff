"""Preflight: refuse, in about a second, a training run that would hang or waste GPU hours.

``data`` checks the packed shards, ``config`` the training knobs, ``machine`` the GPUs,
disks and interconnect; ``run`` reads everything once and runs them all. Every check is a
``tuneloop.judge.verdict.Check``, the type and status vocabulary that ``tuneloop doctor``, the
gate and the release share. Nothing heavy is imported here: import the submodule you need.
"""

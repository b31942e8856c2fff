"""Preflight: refuse, in about a second, a training run that would hang or waste GPU hours.

``data`` checks the packed shards, ``config`` the training knobs, ``machine`` the GPUs,
disks and interconnect; ``run`` reads everything once and runs them all; ``check`` holds the
``Check`` type and status vocabulary that ``tuneloop doctor`` shares. Nothing heavy is
imported here: import the submodule you need.
"""

"""The training stage's parts; ``stages/train.py`` reads top to bottom as the method.

Modules, one concern each:

- ``plan``: what a run will do on this machine (precision, attention, launcher,
  distributed config), decided and checked before any work; the torchrun re-exec
- ``methods``: models, LoRA/QLoRA/full set-up, the SFT and DPO trainers and their
  arguments; each rank reads its own packed shard
- ``checkpoints``: which checkpoints belong to this run, the newest complete one,
  phase results kept for resume, the ``checkpoint-N`` names
- ``stoploss``: wall-time, memory and loss-spike rules that end a run cleanly
- ``preemption``: save and stop when the scheduler asks, before the job's time limit
- ``merge``: stage ``merge``'s work: fold a LoRA adapter into its base and check that the
  merged model answers as the adapter model did

``plan`` imports no torch at module level, so ``main()`` can decide to re-exec
under torchrun quickly; the others import the training stack. This file imports
nothing, so importing ``plan`` costs only ``plan``.
"""

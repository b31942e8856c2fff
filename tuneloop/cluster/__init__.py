"""Training across nodes: the train stage submits the ranks to a scheduler and waits.

``train.launcher`` picks it: ``slurm`` (``slurm``: one sbatch job, one task per node, each the
node's watchdog around the node's torchrun) or ``kubernetes`` (``kubernetes``: a Kubeflow
Trainer v2 TrainJob). ``job`` holds what both share: the torchrun line every node runs, the
job's state and its accounting as they reach metrics/train.json and MLflow. ``submit`` is the
stage's side: check, submit, stream the log, wait, cancel, report.
"""

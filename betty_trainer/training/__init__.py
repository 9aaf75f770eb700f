"""Training: the epoch loop, the plan dry run, evaluation, checkpoints, inference and the run directory."""

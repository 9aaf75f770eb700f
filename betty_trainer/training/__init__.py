"""Training: one micro-batch step, the epoch loop, evaluation, checkpoints and the run directory."""

"""The train stage."""

from trainflow.tasks.train.early_signal import hold_early_preemption

# Unpickling a training job imports this package first: from here on, a requeue signal that
# arrives while the rest (torch) is still importing is held instead of killing the rank.
hold_early_preemption()

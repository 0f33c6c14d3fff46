"""Run management (layer 4): checkpoints, preemption, the run's identity, its Ray cluster, tracking and the
loggers, the console, and the dumps of generations."""

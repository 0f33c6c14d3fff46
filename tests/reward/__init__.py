"""Tests of scaletrain.reward: scorers, custom function loading, the timed worker pool, reward managers."""

"""The single controller: ``fit()`` drives rollout, reward, advantages, updates, validation, checkpoints and logging."""

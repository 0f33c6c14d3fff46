"""verl.trainer.ppo: ``core_algos`` (estimators, policy losses, aggregation, KL)."""

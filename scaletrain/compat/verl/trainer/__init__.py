"""verl.trainer: the algorithm module (``trainer.ppo.core_algos``) a verl user's extension code imports."""

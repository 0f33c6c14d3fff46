"""verl.workers: the worker config classes a verl policy loss reads (``workers.config.actor``) and the reward
managers (``workers.reward_manager``)."""

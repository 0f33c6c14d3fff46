"""``verl.experimental.reward_loop``: verl 0.9's per-sample reward managers (``reward_manager``)."""

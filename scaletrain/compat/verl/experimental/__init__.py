"""``verl.experimental``: the one experimental API of verl 0.9 a user's code extends, the reward-loop managers."""

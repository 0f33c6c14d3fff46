"""One training step's parts (layer 4): advantages and the in-reward KL, balancing, overlong masking, rollout
correction, and the step's and validation's metrics."""

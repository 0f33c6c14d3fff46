"""Rollout production for the PPO trainer (layer 4): the producer of scored batches (producer.py: sampling,
generation, reward, ReMax, DAPO's refill), the schedules that draw them for each step (schedules.py: sync and
one-step-off; fully_async.py), the weight sync into the rollout engines and split placement's rollout pool."""

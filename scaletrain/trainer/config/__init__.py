"""The PPO and SFT trainers' config (layer 4): the config dataclasses, their checks before Ray, the run plan,
the workers' configs derived from them and verl's key names."""

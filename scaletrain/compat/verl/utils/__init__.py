"""verl.utils: the helpers a verl user's code imports (metrics, dict helpers, tensordict helpers, devices)."""

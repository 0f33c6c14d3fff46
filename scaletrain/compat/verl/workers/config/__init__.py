"""verl.workers.config: verl's role config classes over scaletrain's."""

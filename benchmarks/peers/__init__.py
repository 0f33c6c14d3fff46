"""Side-by-side benchmarks against the peers (verl, TRL): ``make bench-peers`` (see README.md here)."""

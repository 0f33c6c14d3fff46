"""The base of scaletrain's refusals of bad input that code written for verl also catches (shared, layer 0)."""


class InvalidInput(ValueError, AssertionError):
    """A refused input: a ValueError, as scaletrain's callers expect, and an AssertionError, as code written for
    verl expects of the same refusals (verl asserts them)."""

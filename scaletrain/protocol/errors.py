"""The error DataProto operations raise on bad input (layer 0: shared by every layer)."""


class DataProtoError(ValueError, AssertionError):
    """A DataProto operation refused its input (mismatched rows, unknown keys, conflicting values, ...).

    A ValueError, as scaletrain's callers expect; also an AssertionError, as code written for verl expects of the
    same refusals (verl asserts them)."""

"""The error DataProto operations raise on bad input (layer 0: shared by every layer)."""

from scaletrain.utils.errors import InvalidInput


class DataProtoError(InvalidInput):
    """A DataProto operation refused its input (mismatched rows, unknown keys, conflicting values, ...)."""

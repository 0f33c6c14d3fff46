"""``verl.utils.tensordict_utils`` (part): building verl's TensorDict batch layout (scaletrain.protocol's)."""

from scaletrain.protocol.tensordict_io import get_tensordict

__all__ = ["get_tensordict"]

"""The rollout engine's memory lifecycle as a small explicit state machine (layer 1).

A rollout engine colocated with a trainer shares the device with it, so its memory comes and goes:

    SERVING --sleep--> SLEEPING --wake_weights--> WEIGHTS --wake_kv_cache--> SERVING
    WEIGHTS --sleep--> SLEEPING

- SERVING: weights and KV cache resident: ``generate`` and ``update_weights`` are allowed.
- SLEEPING: both released (vLLM sleep level 1: weights offloaded to CPU, KV cache dropped): the trainer has the
  device. Nothing but ``wake_weights`` is allowed.
- WEIGHTS: weights resident, no KV cache yet: the state to update weights in, without the KV cache competing
  with the trainer's export for memory.

Every other move (waking the KV cache before the weights, updating or generating on a sleeping engine, sleeping
twice) raises ``IllegalTransition`` naming the state and the legal moves. A new engine is SERVING (vLLM starts
awake). Where the platform has no sleep mode (CPU), the engine's ``sleep`` / ``wake_up`` release nothing, but the
states and their checks are the same, so CPU tests exercise the order a GPU run takes.
"""

from __future__ import annotations

from enum import Enum


class EngineState(str, Enum):
    SERVING = "serving"
    SLEEPING = "sleeping"
    WEIGHTS = "weights"


class IllegalTransition(RuntimeError):
    """A lifecycle move or engine call the current state does not allow."""


# (move, from state) -> to state
_MOVES = {
    ("sleep", EngineState.SERVING): EngineState.SLEEPING,
    ("sleep", EngineState.WEIGHTS): EngineState.SLEEPING,
    ("wake_weights", EngineState.SLEEPING): EngineState.WEIGHTS,
    ("wake_kv_cache", EngineState.WEIGHTS): EngineState.SERVING,
}
# engine call -> the states it is allowed in
_CALLS = {
    "generate": (EngineState.SERVING,),
    "update_weights": (EngineState.WEIGHTS, EngineState.SERVING),
}


class EngineLifecycle:
    """Owns a rollout engine's state; the only caller of its ``sleep`` / ``wake_up``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.state = EngineState.SERVING
        self.history: list[str] = []  # moves taken, in order (for tests and debugging)

    def _move(self, move: str) -> None:
        target = _MOVES.get((move, self.state))
        if target is None:
            legal = [m for (m, s) in _MOVES if s is self.state]
            raise IllegalTransition(
                f"rollout engine: cannot {move} while {self.state.value}; legal now: {', '.join(legal)}"
            )
        self.state = target
        self.history.append(move)

    def sleep(self) -> None:
        self._move("sleep")
        self.engine.sleep()

    def wake_weights(self) -> None:
        self._move("wake_weights")
        self.engine.wake_up(("weights",))

    def wake_kv_cache(self) -> None:
        self._move("wake_kv_cache")
        self.engine.wake_up(("kv_cache",))

    def require(self, call: str) -> None:
        """Raise unless the engine ``call`` ("generate" | "update_weights") is allowed now."""
        allowed = _CALLS[call]
        if self.state not in allowed:
            raise IllegalTransition(
                f"rollout engine: {call}() needs state {' or '.join(s.value for s in allowed)}, "
                f"it is {self.state.value}; wake it first"
            )

    # ------------------------------------------------------------------------------------------ whole moves
    def ensure_weights(self) -> None:
        """Weights resident (from any state): ready for ``update_weights``."""
        if self.state is EngineState.SLEEPING:
            self.wake_weights()

    def ensure_serving(self) -> None:
        """Weights and KV cache resident (from any state): ready for ``generate``."""
        self.ensure_weights()
        if self.state is EngineState.WEIGHTS:
            self.wake_kv_cache()

    def ensure_sleeping(self) -> None:
        if self.state is not EngineState.SLEEPING:
            self.sleep()

"""scaletrain: scale-out RL post-training for LLMs.

Layers (arrows point down): trainer/ (single controller, fit()) -> controller/ (worker groups, dispatch) ->
workers/ (role workers) -> backends/ (training and rollout engines). protocol.py (DataProto), algos/, reward/,
data/ and agent/ are shared building blocks that import nothing from the layers above them.
"""

__version__ = "0.1.0"

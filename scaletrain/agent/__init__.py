"""Agent loops for multi-turn rollouts (tools, simulated users) on the async rollout path.

    from scaletrain.agent import AgentLoopBase, register_agent_loop, ToolAgentLoop, AgentState, AgentData, \\
        AgentLoopOutput, ToolParser, FunctionCall, BaseTool, ToolResponse, BaseInteraction

Files: base.py (states, data, output, registry), single_turn.py / tool_agent.py (the built-in loops),
tool_parser.py (ToolParser registry, hermes), tools/ (BaseTool, calculator, code runner, search + a local
retrieval server), interactions/ (BaseInteraction, answer checker), server.py (batching client of the rollout
engines, sticky routing), manager.py (runs the loops concurrently, assembles the DataProto).
"""

from scaletrain.agent.base import (
    AGENT_LOOPS,
    AgentData,
    AgentLoopBase,
    AgentLoopOutput,
    AgentState,
    get_agent_loop,
    register_agent_loop,
)
from scaletrain.agent.interactions.base import BaseInteraction, load_interactions, register_interaction
from scaletrain.agent.single_turn import SingleTurnAgentLoop
from scaletrain.agent.tool_agent import ToolAgentLoop
from scaletrain.agent.tool_parser import FunctionCall, ToolParser
from scaletrain.agent.tools.base import BaseTool, ToolResponse, load_tools, register_tool

__all__ = [
    "AGENT_LOOPS",
    "AgentData",
    "AgentLoopBase",
    "AgentLoopOutput",
    "AgentState",
    "BaseInteraction",
    "BaseTool",
    "FunctionCall",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "ToolParser",
    "ToolResponse",
    "get_agent_loop",
    "load_interactions",
    "load_tools",
    "register_agent_loop",
    "register_interaction",
    "register_tool",
]

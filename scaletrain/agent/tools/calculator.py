"""``calculator``: evaluates an arithmetic expression (numbers, + - * / // % **, parentheses) safely via the AST.

No names, calls or attributes are evaluated, exponents are bounded, and an error (bad syntax, division by zero)
comes back to the model as text. Optional reward: ``config.reward_correct`` when the result equals
``tools_kwargs.calculator.create_kwargs.ground_truth`` (default 0: the tool itself gives no reward).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from scaletrain.agent.tools.base import BaseTool, ToolResponse, register_tool

OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100
MAX_LENGTH = 500


def evaluate(expression: str) -> float | int:
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} too large")
            return OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported element {type(node).__name__}")

    return ev(ast.parse(expression.strip(), mode="eval"))


def format_number(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


@register_tool("calculator")
class CalculatorTool(BaseTool):
    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="Error: 'expression' must be a string"), 0.0, {"error": 1.0}
        try:
            result = format_number(evaluate(expression))
        except Exception as exc:
            return ToolResponse(text=f"Error: {type(exc).__name__}: {exc}"), 0.0, {"error": 1.0}
        reward = 0.0
        truth = self._instances.get(instance_id, {}).get("ground_truth")
        if truth is not None and result == str(truth).strip():
            reward = float(self.config.get("reward_correct", 0.0))
        return ToolResponse(text=result), reward, {}

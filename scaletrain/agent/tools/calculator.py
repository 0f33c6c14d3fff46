"""``calculator``: evaluates an arithmetic expression (numbers, + - * / // % **, parentheses) safely via the AST.

No names, calls or attributes are evaluated. The tool runs on the driver's event loop, so the cost of an
expression is bounded *before* any work is done: the text is at most ``MAX_LENGTH`` characters, the AST at most
``MAX_NODES`` values/operations and ``MAX_DEPTH`` levels deep, exponents at most ``MAX_EXPONENT`` in magnitude,
and every integer operation is refused when its result would exceed ``MAX_DIGITS`` digits (estimated from the
operands' bit lengths before computing it: a nested ``((9**99)**99)**99`` or a long chain of products cannot
grow without bound). An error (bad syntax, division by zero, too large) comes back to the model as text.
Optional reward: ``config.reward_correct`` when the result equals
``tools_kwargs.calculator.create_kwargs.ground_truth`` (default 0: the tool itself gives no reward).
"""

from __future__ import annotations

import ast
import math
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
MAX_NODES = 512  # numbers + operations
MAX_DEPTH = 256  # well under Python's recursion limit, even when called from deep in the event loop
# Python refuses to print integers longer than this by default (sys.get_int_max_str_digits), so a larger result
# could not be shown to the model anyway; products / powers of such sizes take microseconds
MAX_DIGITS = 4300
MAX_BITS = int(MAX_DIGITS * math.log2(10))


def _too_large(bits: int, what: str) -> ValueError:
    digits = int(bits * math.log10(2)) + 1
    return ValueError(f"{what} would have about {digits} digits (limit {MAX_DIGITS})")


def _check_shape(tree: ast.AST) -> None:
    """Refuse an AST with more than MAX_NODES values / operations or deeper than MAX_DEPTH (iteratively: the
    check itself must not recurse as deep as the tree)."""
    nodes, stack = 0, [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"expression nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Constant)):
            nodes += 1
            if nodes > MAX_NODES:
                raise ValueError(f"expression has more than {MAX_NODES} numbers and operations")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _binop(op: ast.operator, left: Any, right: Any) -> Any:
    """``left op right``, refused before computing when an integer result would be too large."""
    both_int = isinstance(left, int) and isinstance(right, int)
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            shown = right if abs(right) < 1e20 else f"{float(right):.3g}" if abs(right) < 1e300 else "(huge)"
            raise ValueError(f"exponent {shown} too large (limit {MAX_EXPONENT})")
        # |base| < 2**b, so |base|**e < 2**(b*e): an upper bound on the result's size, known before computing it
        if both_int and right > 0 and abs(left).bit_length() * right > MAX_BITS:
            raise _too_large(abs(left).bit_length() * right, "the result of **")
    elif isinstance(op, ast.Mult) and both_int and left.bit_length() + right.bit_length() > MAX_BITS + 1:
        raise _too_large(left.bit_length() + right.bit_length(), "the result of *")
    result = OPS[type(op)](left, right)
    if isinstance(result, int) and result.bit_length() > MAX_BITS:  # + and - grow by one bit at most
        raise _too_large(result.bit_length(), "the result")
    if isinstance(result, complex):  # a negative number to a fractional power
        raise ValueError(f"{left!r} ** {right!r} is not a real number")
    return result


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError (or ZeroDivisionError / OverflowError / SyntaxError)
    naming the problem otherwise. Bounded in time and memory whatever the input (see the module docstring)."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    tree = ast.parse(expression.strip(), mode="eval")
    _check_shape(tree)

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return _binop(node.op, ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported element {type(node).__name__}")

    return ev(tree)


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

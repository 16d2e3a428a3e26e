"""The ``calculator`` tool: arithmetic on an expression, without eval.

The expression is parsed with Python's ``ast`` and only numbers, + - * / // % **,
unary signs, parentheses and a few functions of ``math`` are evaluated; anything
else is refused. Exponents and results are bounded so ``9**9**9`` cannot stall a worker.
"""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {name: getattr(math, name) for name in
              ("sqrt", "log", "log10", "exp", "sin", "cos", "tan", "floor", "ceil", "fabs")}  # fmt: skip
_CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e300
MAX_LENGTH = 500


class CalculatorError(ValueError):
    pass


def evaluate(expression: str) -> float | int:
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from exc
    return _eval(tree.body)


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError, ValueError) as exc:
            raise CalculatorError(str(exc)) from exc
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("result out of range")
        return value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and len(node.args) == 1 and not node.keywords):  # fmt: skip
        try:
            return _FUNCTIONS[node.func.id](_eval(node.args[0]))
        except (ValueError, OverflowError) as exc:
            raise CalculatorError(str(exc)) from exc
    raise CalculatorError(f"unsupported element: {ast.dump(node)[:60]}")

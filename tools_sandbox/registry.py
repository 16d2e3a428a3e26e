"""The server-side tools: their argument schemas (pydantic), and how each one runs.

``openai_tool`` renders a tool as an OpenAI function definition for the engine;
``execute`` validates a call's arguments and runs it (inside an rq job, see
tools_sandbox.jobs). Every failure becomes an ``Outcome`` the model can read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tools_sandbox.calculator import CalculatorError, evaluate
from tools_sandbox.outcome import Outcome
from tools_sandbox.python_tool import Limits, run_python
from tools_sandbox.retrieval import retrieve


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PythonArguments(_Arguments):
    code: str = Field(min_length=1, max_length=20_000, description="Python 3 source; print what you want to see")


class RetrieveArguments(_Arguments):
    query: str = Field(min_length=1, max_length=1000, description="what to search the document corpus for")
    k: int = Field(default=3, ge=1, le=10, description="how many passages to return")


class CalculatorArguments(_Arguments):
    expression: str = Field(min_length=1, max_length=500, description="an arithmetic expression, e.g. (2+3)*sqrt(2)")


def _python(args: PythonArguments) -> Outcome:
    return run_python(args.code, PYTHON_LIMITS)


def _retrieve(args: RetrieveArguments) -> Outcome:
    passages = retrieve(args.query, args.k)
    if not passages:
        return Outcome(True, "no passage matches the query")
    return Outcome(True, "\n\n".join(f"[{i}] ({p.source}) {p.text}" for i, p in enumerate(passages, 1)))


def _calculator(args: CalculatorArguments) -> Outcome:
    try:
        return Outcome(True, repr(evaluate(args.expression)))
    except CalculatorError as exc:
        return Outcome(False, f"calculator error: {exc}")


@dataclass(frozen=True)
class ServerTool:
    name: str
    description: str
    arguments: type[_Arguments]
    run: Callable[[Any], Outcome]
    timeout_s: float  # the rq job's timeout (the tool's own limits are tighter)


PYTHON_LIMITS = Limits(wall_s=15.0, cpu_s=10, output_bytes=64 * 1024)  # CPU-bound code hits the CPU limit first
TOOLS: dict[str, ServerTool] = {
    t.name: t
    for t in [
        ServerTool(
            "python",
            "Run Python 3 code in a sandbox (no network, no persistent files) and return what it prints.",
            PythonArguments,
            _python,
            PYTHON_LIMITS.wall_s + 5,
        ),  # fmt: skip
        ServerTool(
            "retrieve",
            "Search the document corpus and return the most relevant passages.",
            RetrieveArguments,
            _retrieve,
            10.0,
        ),  # fmt: skip
        ServerTool("calculator", "Evaluate an arithmetic expression exactly.", CalculatorArguments, _calculator, 5.0),
    ]
}


def openai_tool(tool: ServerTool) -> dict[str, Any]:
    schema = tool.arguments.model_json_schema()
    schema.pop("title", None)
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": schema}}


def execute(name: str, arguments: str) -> Outcome:
    tool = TOOLS.get(name)
    if tool is None:
        return Outcome(False, f"unknown tool {name!r}")
    try:
        parsed = tool.arguments.model_validate(json.loads(arguments or "{}"))
    except (json.JSONDecodeError, ValidationError) as exc:
        return Outcome(False, f"invalid arguments for {name}: {exc}")
    return tool.run(parsed)

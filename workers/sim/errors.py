"""Errors as vLLM's OpenAI server shapes them: ``{"error": {message, type, param, code}}``.

An ``EngineError`` raised anywhere in a route becomes its body and status; a request that
fails validation is a 400 (not FastAPI's 422), with pydantic's errors in one message.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from workers.sim import protocol as p


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(p.EngineError, _engine_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


async def _engine_error(_: Request, exc: p.EngineError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(_validation_body(exc.errors()), status_code=400)


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` as ``model``, or the 400 a route's own validation would give."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise p.EngineError(400, _validation_message(exc.errors()), "Bad Request", _param(exc.errors())) from exc


def _validation_body(errors: Any) -> dict[str, Any]:
    return p.error_body(400, _validation_message(errors), "Bad Request", _param(errors))


def _validation_message(errors: Any) -> str:
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}" for e in errors]
    return f"{len(parts)} validation error{'s' if len(parts) != 1 else ''}: " + "; ".join(parts)


def _param(errors: Any) -> str | None:
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if loc:
            return loc[0]
    return None

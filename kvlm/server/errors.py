"""Every error the server sends has OpenAI's shape: {"error": {"message", "type", "param", "code"}}, except on the
Messages API's paths (/v1/messages...), where it has Anthropic's: {"type": "error", "error": {"type", "message"}}.

Bad input is a 4xx with a message naming the field; nothing a client sends produces a 500 or a stack trace.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvlm.server.async_engine import EngineFailure
from kvlm.server.protocol import BadRequest

log = logging.getLogger("kvlm")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 500: "server_error", 503: "server_error"}


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def anthropic_error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error"),
                                       "message": message}}


def error_response(request: Request, message: str, status: int, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """The error in the shape of the API the request was made to."""
    if request.url.path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error_body(message, status), status_code=status)
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def _field_path(location: tuple) -> list[str]:
    """The field path of a pydantic error location, without "body" and without the union member tried
    (pydantic adds e.g. "str" or "list[int]" when a field accepts several types)."""
    path = []
    for part in location[1:] if location[:1] == ("body",) else location:
        if isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()):
            break
        path.append(str(part))
    return path


def _validation_message(error: dict) -> tuple[str, str | None]:
    """One pydantic error as a sentence, and the field it is about."""
    location = _field_path(tuple(error.get("loc", ())))
    param = ".".join(location) or None
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing" and param is None:
        return "a JSON object is required as the request body", None
    if kind == "missing":
        return f"the field {param!r} is required", param
    if not location:
        return f"the request body must be a JSON object: {error.get('msg')}", None
    return f"{param}: {error.get('msg')} (got {error.get('input')!r})", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
        return error_response(request, message, 400, param)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(request, str(exc), exc.status, exc.param, exc.code)

    @app.exception_handler(EngineFailure)
    async def engine_failure(request: Request, exc: EngineFailure) -> JSONResponse:
        return error_response(request, str(exc), 500)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(request, str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return error_response(request, f"internal error ({type(exc).__name__}); the server logged the details", 500)

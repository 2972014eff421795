"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`,
the type named by the HTTP status as OpenAI names it."""

from __future__ import annotations

from typing import Optional

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 409: "conflict_error",
                429: "rate_limit_error", 500: "internal_server_error",
                503: "service_unavailable"}


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "internal_server_error"


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status}}

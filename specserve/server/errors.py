"""The API's errors: an HTTP status with an OpenAI-style body naming what was wrong. Torch-free, so the
modules that check requests (and the server's flags) load without the engine."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        outcome: str = "rejected",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.outcome = outcome  # for the metrics: "rejected" before a request runs, "failed" after

    @property
    def reason(self) -> str:
        return self.code or f"http_{self.status}"

    def body(self) -> dict:
        return error_body(self.message, _ERROR_TYPES.get(self.status, "invalid_request_error"), self.param, self.code)


_ERROR_TYPES = {
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def show(v: Any) -> str:
    """A short repr for error messages: the offending value may be a megabyte long."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."

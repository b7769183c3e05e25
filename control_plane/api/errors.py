"""OpenAI-style API errors: `{"error": {"message", "type", "code"}}` with the matching HTTP status."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError


@dataclass
class APIError(Exception):
    """An error the server answers with; `headers` are added to the response (e.g. Retry-After)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, code: str | None = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or invalid API key (send 'Authorization: Bearer <key>')",
        "authentication_error",
        "invalid_api_key",
    )


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, "invalid_request_error", code)


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes", "invalid_request_error", "payload_too_large")


def too_many_requests(retry_after_s: int, pending: int) -> APIError:
    return APIError(
        429,
        f"server is at capacity ({pending} requests in flight); retry after {retry_after_s} s",
        "rate_limit_error",
        "too_many_requests",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", "service_unavailable")


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", "internal_error")


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {err['msg']}", "invalid_json")
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    if err["type"] == "model_type" and not loc:
        return bad_request("request body must be a JSON object", "invalid_json")
    where = f"'{loc}': " if loc else ""
    return bad_request(f"{where}{err['msg']}", "invalid_value", loc or None)


def _is_union_tag(part) -> bool:
    """pydantic names union members in error locations (e.g. 'list[int]'); they are not field names."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))

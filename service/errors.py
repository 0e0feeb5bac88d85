"""Errors the service raises above the runtime: one exception type and its kinds. No HTTP here: the one
table from kind to status, and from the runtime's own errors to a kind, is `service.http.errors`.

The shape on the wire is text-embeddings-inference's, `{"error": str, "error_type": str}`, so its
clients work.
"""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    BAD_REQUEST = "bad_request"  # unreadable body: invalid JSON or UTF-8
    VALIDATION = "validation"  # well-formed but wrong: types, empty texts, unknown options
    TOO_LARGE = "payload_too_large"  # body, pair count or text length over a limit
    UNAUTHORIZED = "unauthorized"  # no, a malformed or a wrong API key
    FORBIDDEN = "forbidden"  # the admin routes, where no key is set to guard them
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"  # a model the server does not serve (with several served)
    CONFLICT = "conflict"  # a reload of that model is already under way
    RELOAD_FAILED = "reload_failed"  # the new checkpoint did not load or warm up; the old one serves
    METHOD = "method_not_allowed"
    TIMEOUT = "timeout"  # the request's deadline passed before its work ran
    CLIENT_CLOSED = "client_closed"  # the client went away; nobody reads this answer
    OVERLOADED = "overloaded"  # admission full: retry later
    RATE_LIMITED = "rate_limited"
    NOT_READY = "not_ready"  # loading, warming up or draining
    BACKEND = "backend"  # the forward pass failed
    NO_SPACE = "insufficient_storage"  # a score job would leave the jobs directory less than its free minimum


class ServiceError(Exception):
    def __init__(self, kind: ErrorKind, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after

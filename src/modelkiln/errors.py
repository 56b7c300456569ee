"""Typed errors. Each one carries an ``ErrorKind``; every transport maps kinds to its own
status codes in exactly one place (HTTP in ``serve/http/errors.py``, gRPC in ``serve/grpc``), and the
CLI prints ``str(err)``."""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    """What went wrong, independent of the transport that reports it."""

    INVALID_INPUT = "invalid_input"  # HTTP 400, gRPC INVALID_ARGUMENT
    NOT_FOUND = "not_found"  # 404, NOT_FOUND
    NOT_READY = "not_ready"  # 503, UNAVAILABLE
    OVERLOADED = "overloaded"  # 503 + Retry-After, RESOURCE_EXHAUSTED
    TIMED_OUT = "timed_out"  # 503 + Retry-After, DEADLINE_EXCEEDED
    TOO_LARGE = "too_large"  # 413, RESOURCE_EXHAUSTED
    UNAUTHENTICATED = "unauthenticated"  # 401, UNAUTHENTICATED
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405 (HTTP only), UNIMPLEMENTED
    INTERNAL = "internal"  # 500, INTERNAL


class KilnError(Exception):
    """Base class: an expected failure with a one-line, user-facing message."""

    kind: ErrorKind = ErrorKind.INTERNAL


# --- conversion -------------------------------------------------------------------------------


class ConversionError(KilnError):
    """Conversion could not produce an artifact."""


class UnknownTaskError(ConversionError):
    kind = ErrorKind.INVALID_INPUT


class TaskNotSupportedError(ConversionError):
    """The model's architecture cannot do the requested task (e.g. a classifier asked for QA)."""

    kind = ErrorKind.INVALID_INPUT


class UnsupportedArchitectureError(ConversionError):
    kind = ErrorKind.INVALID_INPUT


class ModelLoadError(ConversionError):
    """Model or tokenizer files are missing or corrupt."""

    kind = ErrorKind.INVALID_INPUT


class ModelTooLargeError(ConversionError):
    """The model needs more memory to export than the options allow (``--max-model-gb``)."""

    kind = ErrorKind.INVALID_INPUT


class OutputNotWritableError(ConversionError):
    kind = ErrorKind.INVALID_INPUT


class ValidationFailedError(ConversionError):
    """No variant stayed within its tolerance against the PyTorch reference."""


# --- artifacts and runtime --------------------------------------------------------------------


class ArtifactError(KilnError):
    """An artifact folder is missing, incomplete or from an incompatible version."""

    kind = ErrorKind.INVALID_INPUT


class VariantNotFoundError(ArtifactError):
    kind = ErrorKind.NOT_FOUND


# --- requests (serving) -----------------------------------------------------------------------


class InvalidInputError(KilnError):
    """The request is malformed or does not fit the model (400)."""

    kind = ErrorKind.INVALID_INPUT


class GrammarLimitError(InvalidInputError):
    """A request's grammar went past the grammar engine's limits on a token it had allowed (an
    object of thousands of optional properties): the request's fault, found only while answering,
    as every grammar is checked along its shortest answer before any compute (structured_output/grammars.py)."""


class ModelNotFoundError(KilnError):
    kind = ErrorKind.NOT_FOUND


class RouteNotFoundError(KilnError):
    kind = ErrorKind.NOT_FOUND


class ResponseNotFoundError(KilnError):
    """A stored response (OpenAI's Responses API) this server does not hold (404)."""

    kind = ErrorKind.NOT_FOUND


class UnauthorizedError(KilnError):
    kind = ErrorKind.UNAUTHENTICATED


class MethodNotAllowedError(KilnError):
    """A route asked with the wrong HTTP method (the inference routes take POST only)."""

    kind = ErrorKind.METHOD_NOT_ALLOWED


class PayloadTooLargeError(KilnError):
    kind = ErrorKind.TOO_LARGE


class OverloadedError(KilnError):
    """The queue is full: try again later (503 with Retry-After)."""

    kind = ErrorKind.OVERLOADED


class RequestTimeoutError(KilnError):
    """The request waited longer than its deadline (503, as Triton answers)."""

    kind = ErrorKind.TIMED_OUT


class ModelNotReadyError(KilnError):
    kind = ErrorKind.NOT_READY


class ModelControlError(KilnError):
    """A model repository operation (load, unload) this server does not allow."""

    kind = ErrorKind.METHOD_NOT_ALLOWED

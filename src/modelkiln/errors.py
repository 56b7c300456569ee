"""Typed errors. Each one carries the HTTP status it maps to, so the server and the CLI
translate errors in exactly one place (``serve`` reads ``status_code``; the CLI prints ``str(err)``)."""

from __future__ import annotations


class KilnError(Exception):
    """Base class: an expected failure with a one-line, user-facing message."""

    status_code: int = 500


# --- conversion -------------------------------------------------------------------------------


class ConversionError(KilnError):
    """Conversion could not produce an artifact."""


class UnknownTaskError(ConversionError):
    status_code = 400


class TaskNotSupportedError(ConversionError):
    """The model's architecture cannot do the requested task (e.g. a classifier asked for QA)."""

    status_code = 400


class UnsupportedArchitectureError(ConversionError):
    status_code = 400


class ModelLoadError(ConversionError):
    """Model or tokenizer files are missing or corrupt."""

    status_code = 400


class OutputNotWritableError(ConversionError):
    status_code = 400


class ValidationFailedError(ConversionError):
    """No variant stayed within its tolerance against the PyTorch reference."""


# --- artifacts and runtime --------------------------------------------------------------------


class ArtifactError(KilnError):
    """An artifact folder is missing, incomplete or from an incompatible version."""

    status_code = 400


class VariantNotFoundError(ArtifactError):
    status_code = 404


# --- requests (serving) -----------------------------------------------------------------------


class InvalidInputError(KilnError):
    """The request is malformed or does not fit the model (400)."""

    status_code = 400


class ModelNotFoundError(KilnError):
    status_code = 404


class UnauthorizedError(KilnError):
    status_code = 401


class MethodNotAllowedError(KilnError):
    """A route asked with the wrong HTTP method (the inference routes take POST only)."""

    status_code = 405


class PayloadTooLargeError(KilnError):
    status_code = 413


class OverloadedError(KilnError):
    """The queue is full: try again later (503 with Retry-After)."""

    status_code = 503


class RequestTimeoutError(KilnError):
    """The request waited longer than its deadline (503, as Triton answers)."""

    status_code = 503


class ModelNotReadyError(KilnError):
    status_code = 503

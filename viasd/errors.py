"""Typed errors of the via-sd engine.

Every error a user can cause carries the name of the offending field, so that the serving layer
can map it to ``INVALID_ARGUMENT`` / HTTP 400 with a message that says what to fix.
"""

from __future__ import annotations


class ViaSDError(Exception):
    """Base class of every error raised by via-sd."""


class InvalidParameterError(ViaSDError, ValueError):
    """A request or configuration value is out of range or inconsistent.

    ``field`` names the parameter (dotted for nested fields), ``message`` says what is wrong.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # pickles (Ray, multiprocessing) by its two fields, not by the joined message
        return (InvalidParameterError, (self.field, self.message))


class ModelLoadError(ViaSDError):
    """A model could not be found, verified, converted or loaded."""


class ChecksumError(ModelLoadError):
    """A downloaded or assembled model file does not have the expected sha256."""


class MaskError(InvalidParameterError):
    """A layer mask does not fit the model it is applied to."""

    def __init__(self, message: str, field: str = "mask"):
        super().__init__(field, message)

    def __reduce__(self):
        return (MaskError, (self.message, self.field))


class CapacityError(InvalidParameterError):
    """A request does not fit the engine's capacity (KV cache rows or positions): the message
    names the limit (``field``) and its value, so a client knows what to shorten or configure."""

    def __reduce__(self):
        return (CapacityError, (self.field, self.message))


class BackendError(ViaSDError):
    """A part of the engine that runs elsewhere failed for some rows (served: an RPC to the drafter
    or a verifier rank). `component` is "drafter", "verifier" or "correction" (the drafter could
    not draw a rejected block's last token, probability only: the row cannot go on); `code` a
    gRPC status name."""

    def __init__(self, component: str, code: str, details: str):
        self.component, self.code, self.details = component, code, details
        super().__init__(f"{component} {code}: {details}")

    def __reduce__(self):
        return (BackendError, (self.component, self.code, self.details))

    @property
    def unavailable(self) -> bool:
        """The backend is down or too slow (retry elsewhere), rather than broken."""
        return self.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


class MissingDependencyError(ViaSDError, ImportError):
    """A command needs a package of an extra that is not installed (``pip install 'via-sd[EXTRA]'``)."""

    @classmethod
    def of(cls, module: str, extra: str) -> MissingDependencyError:
        return cls(f"{module} is not installed: it comes with via-sd's [{extra}] extra (pip install 'via-sd[{extra}]')")


def require(module: str, extra: str):
    """Import `module`, or raise MissingDependencyError naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingDependencyError.of(module, extra) from exc

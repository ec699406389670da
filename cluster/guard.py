"""What the public gRPC service does around a request: size limit, parsing, drain.

* `PUBLIC_MAX_MESSAGE_BYTES`: the largest request message GenerationService accepts (4 MiB,
  gRPC's own default); the internal drafter / verifier services allow 256 MB
  (`viasd.actors.rpc.GRPC_OPTIONS`) because draft probabilities are large. A bigger message is
  refused by gRPC with RESOURCE_EXHAUSTED before it reaches Python.
* `parse_request`: the Generate handler receives raw bytes and parses them here, so that a
  message protobuf cannot parse (malformed UTF-8 in a string field, a corrupt wire format) is
  INVALID_ARGUMENT naming the field (`prompt`, `messages.content`, ...) instead of gRPC's
  UNKNOWN "Exception deserializing request".
* `Calls`: the requests in flight, so that a draining server can refuse new ones, wait for the
  running ones up to a timeout, then end the rest with finish reason `abort`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import suppress
from typing import TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from viasd.errors import InvalidParameterError

PUBLIC_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
SHUTTING_DOWN = "the server is shutting down"  # why a draining server refuses a request
MAX_REQUEST_ID_CHARS = 256  # echoed in every response: bounded

T = TypeVar("T")


def parse_request(data: bytes, message_class):
    """Parse a request message; InvalidParameterError names the field that does not parse."""
    try:
        return message_class.FromString(data)
    except DecodeError as exc:
        field = _bad_utf8_field(message_class.DESCRIPTOR, data)
        if field is not None:
            raise InvalidParameterError(field, "not valid UTF-8") from None
        raise InvalidParameterError(
            "request", f"not a valid {message_class.DESCRIPTOR.full_name} message: {exc}"
        ) from None


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def _bad_utf8_field(descriptor, data: bytes, prefix: str = "") -> str | None:
    """The dotted name of the first string field of `data` (a `descriptor` message) that is not
    UTF-8, walking the wire format; None when there is none (or the bytes are corrupt elsewhere)."""
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            if wire in (0, 1, 5):  # a varint, 64 or 32 bits
                i = _varint(data, i)[1] if wire == 0 else i + (8 if wire == 1 else 4)
                continue
            if wire != 2:
                return None
            size, i = _varint(data, i)
            payload, i = data[i : i + size], i + size
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                # a wrapper message named like its one repeated field (ChatMessages.messages) reads as one name
                inner = _bad_utf8_field(field.message_type, payload, name + ".")
                if inner is not None:
                    return inner.replace(f"{name}.{field.name}.", f"{name}.")
    except ValueError:
        return None
    return None


class Aborted(Exception):
    """The server is draining and this request's time is up."""


class Calls:
    """The Generate calls in flight: counted, and aborted together when a drain times out."""

    def __init__(self):
        self.draining = False
        self._running: set[asyncio.Event] = set()
        self._idle: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self._running)

    def enter(self) -> asyncio.Event:
        """Register a call; its event is set when it must end with finish reason `abort`."""
        abort = asyncio.Event()
        self._running.add(abort)
        return abort

    def leave(self, abort: asyncio.Event) -> None:
        self._running.discard(abort)
        if not self._running and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout_s: float, abort_grace_s: float = 10.0) -> int:
        """Refuse new calls (`draining`), wait up to `timeout_s` for the running ones, then abort the
        rest and wait up to `abort_grace_s` for them to end. Returns how many were aborted."""
        self.draining = True
        self._idle = asyncio.Event()
        if self._running:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)
        aborted = len(self._running)
        for abort in list(self._running):
            abort.set()
        if self._running:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), abort_grace_s)
        return aborted


async def until_aborted(awaitable: Awaitable[T], abort: asyncio.Event) -> T:
    """Await `awaitable`, unless `abort` is set first: then cancel it and raise Aborted."""
    task = asyncio.ensure_future(awaitable)
    if abort.is_set():
        task.cancel()
    else:
        stop = asyncio.ensure_future(abort.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this call was cancelled (the client went away): end `awaitable` too, so
            task.cancel()  # that its generator is no longer running when the caller closes it
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
    with suppress(BaseException):  # the request is being aborted; its own error no longer matters
        await task
    raise Aborted()

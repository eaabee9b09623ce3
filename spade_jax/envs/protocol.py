"""Length-prefixed JSON framing between the trainer and sandboxed workers (stdlib only).

A frame is a 4-byte big-endian length followed by that many bytes of ASCII JSON encoding
one object. Requests carry a fresh random nonce `n`; the reply must echo it, so a program
that writes forged replies into its channel cannot have them accepted. Nothing from a
worker is ever unpickled: JSON gives only dicts, lists, strings, numbers, bools and None.
This module is imported inside the sandbox, so it imports nothing outside the stdlib.
"""

from __future__ import annotations

import json
import os
import struct

HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame is malformed, too large, or not a JSON object."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def new_nonce() -> str:
    return os.urandom(8).hex()


def encode(message: dict) -> bytes:
    # ensure_ascii escapes lone surrogates too, so any Python str round-trips.
    body = json.dumps(message, ensure_ascii=True, separators=(",", ":"), allow_nan=True)
    data = body.encode("ascii")
    return HEADER.pack(len(data)) + data


def decode_body(body: bytes) -> dict:
    try:
        message = json.loads(body.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ProtocolError("protocol_violation", f"undecodable frame: {err}") from None
    if type(message) is not dict:
        raise ProtocolError("protocol_violation", "frame is not a JSON object")
    return message


class FrameReader:
    """Incremental frame parser: feed bytes, get complete messages out."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer)
            if length > self.max_bytes:
                raise ProtocolError(
                    "message_too_large", f"frame of {length} bytes > cap {self.max_bytes}"
                )
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[HEADER.size : end])
            del self._buffer[:end]
            messages.append(decode_body(body))
        return messages

    @property
    def pending(self) -> bool:
        return bool(self._buffer)


def read_blocking(fd: int, reader: FrameReader) -> dict | None:
    """Blocks until one message arrives; None on end of file. Used by workers."""
    while True:
        messages = reader.feed(b"")
        if messages:
            if len(messages) > 1:
                raise ProtocolError("protocol_violation", "more than one request in flight")
            return messages[0]
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        messages = reader.feed(chunk)
        if messages:
            if len(messages) > 1:
                raise ProtocolError("protocol_violation", "more than one request in flight")
            return messages[0]


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]

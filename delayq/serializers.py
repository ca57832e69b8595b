"""Payload serializers: turn payloads into bytes and back, with a type tag stored in the row.

The tag is checked when a message is read back, so a queue never decodes bytes written by
another serializer as its own.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from delayq.errors import PayloadError

MAX_TAG_LENGTH = 100
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
"""The largest encoded payload delayq stores: 8 MiB, under MariaDB's default ``max_allowed_packet``
(16 MiB) on every backend, so a message that fits one database fits them all. Store large blobs elsewhere
and put their address in the payload."""


@runtime_checkable
class Serializer(Protocol):
    """Encodes payloads to bytes and back. ``type_tag`` names the format in the row."""

    type_tag: str

    def dumps(self, payload: Any) -> bytes:
        """Encode; raise ``TypeError`` or ``ValueError`` when the payload cannot be encoded."""
        ...

    def loads(self, data: bytes) -> Any:
        """Decode what ``dumps`` produced."""
        ...


class JsonSerializer:
    """JSON (UTF-8, compact, NaN refused). The default."""

    type_tag = "json"

    _encoder = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False)

    def dumps(self, payload: Any) -> bytes:
        return self._encoder.encode(payload).encode()

    def loads(self, data: bytes) -> Any:
        return json.loads(data.decode())  # UTF-8, as written: no encoding detection


class BytesSerializer:
    """Raw bytes, stored as given."""

    type_tag = "bytes"

    def dumps(self, payload: Any) -> bytes:
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"expected bytes, got {type(payload).__name__}")
        return bytes(payload)

    def loads(self, data: bytes) -> bytes:
        return bytes(data)


class TextSerializer:
    """Text, stored as UTF-8."""

    type_tag = "text"

    def dumps(self, payload: Any) -> bytes:
        if not isinstance(payload, str):
            raise TypeError(f"expected str, got {type(payload).__name__}")
        return payload.encode()

    def loads(self, data: bytes) -> str:
        return bytes(data).decode()


def encode(serializer: Serializer, payload: Any) -> bytes:
    """Serialize, turning the serializer's own failure into ``PayloadError``."""
    try:
        data = serializer.dumps(payload)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise PayloadError(
            f"payload cannot be serialized by {type(serializer).__name__} ({serializer.type_tag}): {reason}"
        ) from None if isinstance(exc, RecursionError) else exc
    if len(data) > MAX_PAYLOAD_BYTES:
        raise PayloadError(f"payload is {len(data):,} bytes encoded; delayq stores at most {MAX_PAYLOAD_BYTES:,}")
    return data

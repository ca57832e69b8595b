"""Lock tokens: one per claim attempt, in the UUID version 7 layout, which tells when the claim ran."""

from __future__ import annotations

import datetime as dt
import secrets
import time
import uuid

from delayq.clock import from_ms


def new_token(claimed_ms: int | None = None) -> str:
    """A fresh lock token: one per claim attempt, unique, in the UUID version 7 layout: its first 48 bits
    are the claim's time in epoch ms (the injected clock's, else this process's; for display only, see
    ``claimed_at``), the other 74 are random."""
    ms = time.time_ns() // 1_000_000 if claimed_ms is None else claimed_ms
    bits = (ms & (1 << 48) - 1) << 80 | 0x7 << 76 | secrets.randbits(12) << 64 | 0b10 << 62 | secrets.randbits(62)
    return str(uuid.UUID(int=bits))


def claimed_at(token: str | None) -> dt.datetime | None:
    """When the claim that set ``token`` ran (see ``new_token``); None for another kind of token."""
    if token is None or len(token) != 36 or token[14] != "7":
        return None
    try:
        return from_ms(int(token[:8] + token[9:13], 16))
    except ValueError:
        return None

"""The handlers the chaos workers run (``delayq worker chaos.app:handlers``), configured by environment.

CHAOS_QUEUE is the base queue name (``{base}-plain`` and ``{base}-tx``), CHAOS_VT the visibility timeout in
seconds, CHAOS_HISTORY the directory of JSONL histories. Each handler records its start and its end (key,
pid, attempt, lock token, monotonic and wall times); the transactional one also inserts one row into
``chaos_effects`` inside the transaction that deletes its message. Warnings of the ``delayq`` loggers
(lock lost, could not ack, ...) are recorded too: the checker uses lost-lock lines as explanations.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from delayq import Delivery, Handler, RetryPolicy

from .history import Recorder

effects_metadata = sa.MetaData()
effects = sa.Table(
    "chaos_effects",
    effects_metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),  # deliberately not unique: duplicates are counted
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("token", sa.String(36), nullable=False),
)

KEY = re.compile(r"'([pt]-\d+)'")
BASE = os.environ.get("CHAOS_QUEUE", "chaos")
VT = dt.timedelta(seconds=float(os.environ.get("CHAOS_VT", "3")))
RETRY = RetryPolicy(max_attempts=100, initial_delay=dt.timedelta(milliseconds=200), max_delay=dt.timedelta(seconds=2))

_recorder: Recorder | None = None


def recorder() -> Recorder:
    global _recorder
    if _recorder is None or _recorder.pid != os.getpid():
        _recorder = Recorder(Path(os.environ["CHAOS_HISTORY"]), f"worker-{os.getpid()}")
    return _recorder


def _event(ev: str, delivery: Delivery, kind: str, **more: Any) -> dict[str, Any]:
    return {
        "ev": ev,
        "key": delivery.key,
        "kind": kind,
        "pid": os.getpid(),
        "attempt": delivery.attempts,
        "token": delivery.lock_token,
        **more,
    }


class Plain(Handler):
    """At-least-once: start, sleep as the payload says, end; the worker acks afterwards."""

    queue = f"{BASE}-plain"
    visibility_timeout = VT
    retry = RETRY

    def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> None:
        rec = recorder()
        rec.write(_event("start", delivery, "plain"))
        try:
            time.sleep(float(delivery.payload.get("sleep", 0.0)))
        except BaseException as exc:
            rec.write(_event("fail", delivery, "plain", error=repr(exc)))
            raise
        rec.write(_event("end", delivery, "plain"))


class Transactional(Handler):
    """Exactly-once effects: one ``chaos_effects`` row per run, in the transaction that deletes the message."""

    queue = f"{BASE}-tx"
    visibility_timeout = VT
    retry = RETRY
    transactional = True

    def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> None:
        assert conn is not None
        rec = recorder()
        rec.write(_event("start", delivery, "tx"))
        try:
            conn.execute(
                effects.insert().values(
                    key=delivery.key, pid=os.getpid(), attempt=delivery.attempts, token=delivery.lock_token
                )
            )
            time.sleep(float(delivery.payload.get("sleep", 0.0)))
        except BaseException as exc:
            rec.write(_event("fail", delivery, "tx", error=repr(exc)[:300]))
            raise
        rec.write(_event("end", delivery, "tx"))  # the commit (and so the effect) may still fail


class WarningRecorder(logging.Handler):
    """Puts delayq's warnings into the history, with the keys they name."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            recorder().write({"ev": "log", "pid": os.getpid(), "msg": msg[:500], "keys": KEY.findall(msg)})
        except Exception:
            self.handleError(record)


if "CHAOS_HISTORY" in os.environ:  # in a worker the harness started, not wherever this module is imported
    logging.getLogger("delayq").addHandler(WarningRecorder(logging.WARNING))

handlers = [Plain, Transactional]

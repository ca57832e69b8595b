"""The claim path: claim due messages under a lock token, then ack, extend, retry, dead-letter or give them back."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from delayq import history
from delayq._outcome import Bury, Unfinished, after_failure
from delayq.clock import duration_ms, from_ms, to_ms
from delayq.dialects import ClaimedRow, Dialect, Statements
from delayq.dialects.base import Mode
from delayq.errors import DelayqError, InvalidInputError, SerializationMismatchError
from delayq.messages import Delivery
from delayq.queue._checks import check_key
from delayq.queue._flow import _Flow
from delayq.queue._history import statements as history_sql
from delayq.queue._lifecycle import COMPLETED, Lifecycle, lifecycle_sql
from delayq.queue._lost import _lost_locks
from delayq.queue._tokens import new_token
from delayq.transactions import Using

log = logging.getLogger("delayq")


class _Claims(_Flow):
    """``try_poll``, ``ack_many``, ``extend_many``, ``release``, and what a ``Delivery`` asks of ``DelayedQueue``."""

    def try_poll(self, *, using: Using = None) -> Delivery | None:
        """Lock the next due message for this consumer, or return None when none is due."""
        found = self.try_poll_many(1, using=using)
        return found[0] if found else None

    def try_poll_many(self, limit: int, *, using: Using = None) -> list[Delivery]:
        """Lock up to ``limit`` due messages, oldest due first; an empty list when none is due.

        Each delivery's lock expires after the visibility timeout; ``attempts`` counts it.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidInputError(f"limit must be a positive integer, got {limit!r}")

        tokens: list[str] = []  # one per attempt
        flow = self._cached_flow(using)
        if flow.paused:
            return []

        def op(conn: Connection, dialect: Dialect) -> list[ClaimedRow]:
            # A fresh token on every attempt: when an attempt's commit succeeded unseen (its reply
            # lost), the rows it locked carry a token nobody holds; they are given back below.
            now = self._now_param()
            token = self._claiming = new_token(now.get("now"))
            tokens.append(token)
            params = {"queue_name": self.name, "limit": limit, "token": token, **now}
            if flow.priorities or flow.limited:
                return self._claim_flowing(conn, dialect, self._statements(dialect), params, flow)
            return dialect.claim(conn, self._statements(dialect), params, self._visibility_ms)

        self._claiming = None
        # In the caller's transaction its rollback undoes the claim; in process (SQLite) a failed attempt left nothing.
        owned = (using is None or isinstance(using, Engine)) and self._runner.dialect.unseen_commits
        try:
            dialect = self._runner.dialect
            flowing = flow.priorities or flow.limited
            mode = self._levels_mode(dialect, limit) if flowing else dialect.claim_mode_for(limit)
            rows = self._runner.run(using, op, mode)
        except DBAPIError as exc:
            # A lost connection may have lost a COMMIT's reply only; an error the server sent rolled back.
            if owned and exc.connection_invalidated and self._give_back_unseen(tokens, using):
                self._claiming = None
            raise
        self._claiming = None  # the claim came back: its rows are in hand
        if owned and len(tokens) > 1:  # a retried claim: what an earlier attempt may have committed unseen
            self._give_back_unseen(tokens[:-1], using)
        return self._deliveries(rows, using)

    def _give_back(self, tokens: list[str], *, using: Using = None, retry: bool = True) -> int:
        """Give back every message of claims whose outcome is unknown to their caller (an attempt whose COMMIT
        reply never came, an asyncio claim cancelled in flight): due as when claimed, unlocked, the attempt
        not counted; how many. Nobody holds these tokens: an attempt that failed returned none."""

        def op(conn: Connection, dialect: Dialect) -> int:
            params = {"queue_name": self.name, "tokens": tokens, "vt": self._visibility_ms}
            return int(conn.execute(self._statements(dialect).unclaim_tokens, params).rowcount)

        runner = self._runner if retry else self._runner.once()
        return runner.run(using, op, "statement")

    def _give_back_unseen(self, tokens: list[str], using: Using) -> bool:
        """``_give_back`` once, never raising (the claim's own outcome stands); whether it ran."""
        try:
            given = self._give_back(tokens, using=using, retry=False)
        except Exception as exc:
            log.warning(
                "queue %s: could not give back a claim whose reply never came (%s); its messages return "
                "after their lock expires",
                self.name,
                exc,
            )
            return False
        if given:
            log.info("queue %s: gave back %d message(s) of a claim whose reply never came", self.name, given)
        return True

    def release(self, deliveries: Sequence[Delivery], *, using: Using = None) -> int:
        """Give deliveries back unprocessed: due again at once, the attempt not counted.

        Returns how many were still held. For work that was fetched but never started.
        """
        return self._unclaim([(d.id, d.lock_token, to_ms(d.scheduled_at)) for d in deliveries], using)

    def _unclaim(self, rows: list[tuple[int, str, int]], using: Using) -> int:
        """Put claimed rows (id, token, due) back as they were: due, unlocked, the attempt not counted."""
        params = [{"msg_id": msg_id, "token": token, "due": due} for msg_id, token, due in rows]
        if not params:
            return 0

        def op(conn: Connection, dialect: Dialect) -> int:
            stmt = self._statements(dialect).unclaim
            return sum(conn.execute(stmt, p).rowcount for p in params)

        return self._runner.run(using, op, "transaction")

    def next_due(self, *, using: Using = None) -> dt.timedelta | None:
        """How long until this queue's next message is due (zero when one is due now); None when empty.

        A held message counts at its lock's expiry, when it would be delivered again. None while the
        queue is paused (as its claims see it: ``flow_refresh``); while a concurrency or rate limit holds
        claims back, not before the limit could let one through (a held lock's expiry, the next token).
        """
        flow = self._cached_flow(using)
        if flow.paused:
            return None
        held_back = self._until_limit_frees(using) if flow.limited else None
        params = {"queue_name": self.name, **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> dt.timedelta | None:
            row = conn.execute(self._statements(dialect).next_due, params).one()
            if row.next_due is None:
                return None
            due = dt.timedelta(milliseconds=max(0, int(row.next_due) - int(row.now)))
            return due if held_back is None else max(due, held_back)

        return self._runner.run(using, op, "read")

    def ack_many(self, deliveries: Sequence[Delivery], *, skip_locked: bool = False, using: Using = None) -> int:
        """Delete delivered messages whose locks these deliveries still hold; returns how many.

        Each message is named by its id and lock token: a token alone never deletes anything.
        With ``skip_locked=True`` a message that another transaction holds a row lock on (a
        producer replacing it, an operator's ``SELECT … FOR UPDATE``) is left for a later ack
        instead of waited for: a background ack never blocks behind someone else's transaction.
        A delivery whose lock is gone (expired and taken, or the message replaced or deleted)
        is counted as ``lock_lost``, once; with ``skip_locked=True`` one more SELECT, only when
        not all were acked, tells such deliveries from row-locked ones. A message kept as completed
        records the worker whose claim it was (None outside a worker): deliveries of several workers'
        claims are acked one worker at a time.
        """
        workers = {d._worker_id for d in deliveries}
        if len(workers) > 1:
            return sum(
                self.ack_many([d for d in deliveries if d._worker_id == w], skip_locked=skip_locked, using=using)
                for w in workers
            )
        pairs: dict[tuple[int, str], None] = {}
        for d in deliveries:
            if d.queue != self.name:
                raise InvalidInputError(f"delivery of {d.key!r} belongs to queue {d.queue!r}, not {self.name!r}")
            pairs[d.id, d.lock_token] = None
        if not pairs:
            return 0
        tokens = {token for _, token in pairs}
        keep_mode: Mode = "statement" if self._runner.dialect.keeps_in_one_statement else "transaction"
        if self.lifecycle.keeps:  # every ack keeps its message: one move, in one transaction
            acked, held = self._runner.run(using, self._keeping(deliveries, list(pairs), skip_locked), keep_mode)
            return self._acked(pairs, acked, held)

        def op(conn: Connection, dialect: Dialect) -> tuple[int, set[int]]:
            stmts = self._statements(dialect)
            if len(tokens) == 1 and not skip_locked:
                [token] = tokens
                return int(conn.execute(stmts.ack, {"token": token, "ids": [i for i, _ in pairs]}).rowcount), set()
            held = dialect.held_params(list(pairs))
            if not skip_locked:
                return int(conn.execute(stmts.ack_pairs, held).rowcount), set()
            # What is still ours after this was row-locked elsewhere (a later ack takes it), or offered
            # with ``unique_for`` (kept below); the rest is gone.
            return dialect.delete_held(conn, stmts, held), set()

        acked, held = self._runner.run(using, op, self._runner.dialect.claim_mode if skip_locked else "scan")
        if acked < len(pairs):  # lost locks, row locks held elsewhere, or messages offered with ``unique_for``
            moved, held = self._runner.run(
                using, self._keeping(deliveries, list(pairs), skip_locked, only_unique=True), keep_mode
            )
            acked += moved
        return self._acked(pairs, acked, held)

    def _acked(self, pairs: dict[tuple[int, str], None], acked: int, held: set[int]) -> int:
        if acked > len(pairs):  # cannot happen while ids are unique; never silently
            log.error("%s: an ack of %d deliveries deleted %d rows", self.name, len(pairs), acked)
            raise DelayqError(f"ack of {len(pairs)} deliveries deleted {acked} rows in queue {self.name!r}")
        self._count("acked", acked)
        if acked < len(pairs):
            _lost_locks.count_unacked(self.name, [p for p in pairs if p[0] not in held], acked)
        return acked

    def _keeping(
        self, deliveries: Sequence[Delivery], pairs: list[tuple[int, str]], skip_locked: bool, only_unique: bool = False
    ) -> Callable[[Connection, Dialect], tuple[int, set[int]]]:
        """The ack that keeps: lock the held rows (fenced by their tokens), insert them into the finished
        table as completed with their results and durations, delete them; (how many, the ids still held
        when not all were moved and ``skip_locked``). ``only_unique``: only those offered with ``unique_for``.
        One statement where the dialect has one (``Dialect.keep_held``), else SELECT, INSERT and DELETE."""
        life = self.lifecycle
        results = {d.id: self._encoded_result(d) for d in deliveries}
        durations = {d.id: d._duration_ms for d in deliveries}
        worker = deliveries[0]._worker_id if deliveries else None  # (``ack_many``: one worker's deliveries)

        def shared_shape(conn: Connection, dialect: Dialect, held_params: dict[str, Any]) -> int:
            ls = lifecycle_sql(self._statements(dialect), dialect)
            picked = ls.held_skipping if skip_locked else ls.held
            rows = conn.execute(picked, {**held_params, **self._now_param()}).all()
            if only_unique:
                rows = [r for r in rows if r.unique_for_ms is not None]
            if not rows:
                return 0
            conn.execute(ls.insert_finished, [self._finished_row(r, results, durations, life, worker) for r in rows])
            moved = int(conn.execute(ls.delete_ids, {"ids": [r.id for r in rows]}).rowcount)
            if ls.notify is not None and self.notify:
                conn.execute(ls.notify, {"queue_name": self.name})
            return moved

        def op(conn: Connection, dialect: Dialect) -> tuple[int, set[int]]:
            stmts = self._statements(dialect)
            held_params = dialect.held_params(pairs)
            params = {
                **held_params,
                "keep_ids": list(results),
                "keep_durations": [durations[i] for i in results],
                "keep_results": [results[i][0] for i in results],
                "keep_result_types": [results[i][1] for i in results],
                "retention_ms": life.retention_ms,
                "queue_name": self.name,
                "worker": worker,
                **self._now_param(),
            }
            notify = self.notify and dialect.can_notify
            kept = dialect.keep_held(
                conn, stmts, params, skip_locked=skip_locked, only_unique=only_unique, notify=notify
            )
            moved = kept if kept is not None else shared_shape(conn, dialect, held_params)
            if moved == len(pairs) or not skip_locked:
                return moved, set()
            return moved, set(conn.execute(stmts.held_ids, held_params).scalars())

        return op

    @staticmethod
    def _finished_row(
        r: Any,
        results: dict[int, tuple[bytes | None, str | None]],
        durations: dict[int, int | None],
        life: Lifecycle,
        worker: str | None,
    ) -> dict[str, Any]:
        now = int(r.now)
        result, result_type = results.get(r.id, (None, None))
        return {
            "queue": r.queue,
            "key": r.key,
            "payload": r.payload,
            "payload_type": r.payload_type,
            "state": COMPLETED,
            "scheduled_at_initially": r.scheduled_at_initially,
            "created_at": r.created_at,
            "attempts": r.attempts,
            "last_error": r.last_error,
            "attempt_history": r.attempt_history,
            "headers": r.headers,
            "tags": r.tags,
            "finished_at": now,
            "duration_ms": durations.get(r.id),
            "result": result,
            "result_type": result_type,
            "expires_at": now + max(life.retention_ms, r.unique_for_ms or 0),
            "priority": r.priority,
            "group_key": r.group_key,
            "worker": worker,
        }

    def _encoded_result(self, d: Delivery) -> tuple[bytes | None, str | None]:
        """A handler's result as kept: serialized by the queue's serializer; (None, None) when there is none,
        results are not kept, or it cannot be kept (too large, not serializable: a warning says so)."""
        value = d._result
        if value is None or not self.lifecycle.keep_results:
            return None, None
        try:
            data = self.serializer.dumps(value)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            log.warning(
                "%s: its result was not kept: %s cannot serialize it (%s)", d.label, self.serializer.type_tag, exc
            )
            return None, None
        if len(data) > self.lifecycle.result_limit:
            log.warning(
                "%s: its result was not kept: %d bytes serialized, above result_limit=%d",
                d.label,
                len(data),
                self.lifecycle.result_limit,
            )
            return None, None
        return data, self.serializer.type_tag

    def extend_many(
        self, deliveries: Sequence[Delivery], by: dt.timedelta, *, using: Using = None
    ) -> tuple[list[Delivery], list[Delivery]]:
        """Push the locks of held deliveries to ``by`` from now, all in one go; never shortens one.

        Returns ``(extended, lost)``: the deliveries whose lock was extended (their
        ``locked_until`` updated from the database), and those whose lock is gone (expired and
        taken, or the message replaced or deleted). A delivery in neither list is held but its
        row is locked by another transaction: it was skipped, not waited for; try it again.
        """
        by_ms = duration_ms(by, "by")
        if by_ms <= 0:
            raise InvalidInputError("extend_many(by=...) must be positive")
        pairs = list({(d.id, d.lock_token): None for d in deliveries})
        if not pairs:
            return [], []

        def op(conn: Connection, dialect: Dialect) -> tuple[dict[int, int], set[int]]:
            stmts = self._statements(dialect)
            held = dialect.held_params(pairs)
            expiries = dialect.extend_held(conn, stmts, {**held, "by": by_ms, **self._now_param()})
            if len(expiries) == len(pairs):
                return expiries, set(expiries)
            return expiries, set(conn.execute(stmts.held_ids, held).scalars())

        expiries, held = self._runner.run(using, op, self._runner.dialect.claim_mode)
        extended, lost = [], []
        for d in deliveries:
            if d.id in expiries:
                d.locked_until = from_ms(expiries[d.id])
                extended.append(d)
            elif d.id not in held:
                lost.append(d)
        if lost:
            _lost_locks.count(self.name, [(d.id, d.lock_token) for d in lost])
        return extended, lost

    def _retry(
        self, d: Delivery, delay: dt.timedelta, error: str | None, using: Using, exception: BaseException | None = None
    ) -> bool:
        params = {"msg_id": d.id, "token": d.lock_token, "delay": duration_ms(delay, "delay"), "error": error}
        params.update(self._now_param())
        failure = history.Failure.capture(error, exception)

        def op(conn: Connection, dialect: Dialect) -> bool:
            hs = self._statements(dialect).memo(history_sql)
            row = conn.execute(hs.select_held, params).first()
            if row is None:
                return False
            params["history"] = failure.appended_to(row.attempt_history, row.attempts, int(row.now))
            return bool(conn.execute(hs.retry, params).rowcount == 1)

        held = self._runner.run(using, op, "transaction")
        if held:
            self._count("retried")
        else:
            _lost_locks.count(self.name, [(d.id, d.lock_token)])
        return held

    def _extend(self, d: Delivery, by: dt.timedelta, using: Using) -> bool:
        by_ms = duration_ms(by, "by")
        if by_ms <= 0:
            raise InvalidInputError("extend(by=...) must be positive")
        params = {"msg_id": d.id, "token": d.lock_token, "by": by_ms, **self._now_param()}
        held = self._held_update(lambda s: s.extend, params, using)
        if not held:
            _lost_locks.count(self.name, [(d.id, d.lock_token)])
        return held

    def _held_update(self, pick: Callable[[Statements], sa.Executable], params: dict[str, Any], using: Using) -> bool:
        def op(conn: Connection, dialect: Dialect) -> bool:
            return bool(conn.execute(pick(self._statements(dialect)), params).rowcount == 1)

        return self._runner.run(using, op, "statement")

    def _dead_letter(
        self, d: Delivery, error: str | None, using: Using, exception: BaseException | None = None
    ) -> bool:
        held = self._dead_letter_held([(d.id, d.lock_token, error)], using, exception, d._worker_id) == 1
        if not held:
            _lost_locks.count(self.name, [(d.id, d.lock_token)])
        return held

    def _dead_letter_held(
        self,
        held: Sequence[tuple[int, str, str | None]],
        using: Using,
        exception: BaseException | None = None,
        worker: str | None = None,
    ) -> int:
        """Move held messages ``(id, token, error)`` to the dead letters, in one transaction; how many.

        Each one's attempt history gets this last failure (with ``exception``'s traceback, if any); each keeps
        its priority and group, and the registry id of the ``worker`` whose claim it was (None outside one).
        """
        failures = {error: history.Failure.capture(error, exception) for _, _, error in held}
        keep_dead = self.lifecycle.dead_letter_retention_ms

        def op(conn: Connection, dialect: Dialect) -> int:
            stmts = self._statements(dialect)
            hs = stmts.memo(history_sql)
            moved = 0
            for msg_id, token, error in held:
                params = {"msg_id": msg_id, "token": token, **self._now_param()}
                row = conn.execute(hs.select_held, params).first()
                if row is None:
                    continue
                conn.execute(
                    stmts.insert_dead,
                    {
                        "queue": row.queue,
                        "key": row.key,
                        "payload": row.payload,
                        "payload_type": row.payload_type,
                        "scheduled_at_initially": row.scheduled_at_initially,
                        "created_at": row.created_at,
                        "attempts": row.attempts,
                        "last_error": error,
                        "attempt_history": failures[error].appended_to(row.attempt_history, row.attempts, int(row.now)),
                        "headers": row.headers,
                        "failed_at": row.now,
                        "tags": row.tags,
                        "expires_at": None if keep_dead is None else int(row.now) + keep_dead,
                        "priority": row.priority,
                        "group_key": row.group_key,
                        "worker": worker,
                    },
                )
                moved += conn.execute(stmts.delete_held, params).rowcount
            return moved

        moved = self._runner.run(using, op, "transaction")
        self._count("dead_lettered", moved)
        return moved

    def _deliveries(self, rows: list[ClaimedRow], using: Using) -> list[Delivery]:
        """The deliveries of one claim, each row decoded on its own.

        A row that cannot be decoded, or that was delivered ``max_deliveries`` times without an
        outcome (its consumer died every time), is moved to the dead letters with the reason,
        instead of failing the whole claim or coming back forever. The claim's rows share its
        lock expiry, and often their times too: each distinct time is converted once.
        """
        times: dict[int, dt.datetime] = {}

        def at(ms: int) -> dt.datetime:
            found = times.get(ms)
            if found is None:
                found = times[ms] = from_ms(ms)
            return found

        deliveries: list[Delivery] = []
        dead: list[tuple[int, str, str | None]] = []
        limit = self.max_deliveries
        for row in rows:
            # This claim is delivery ``attempts``: the earlier ones ended without an outcome. Only a row at the
            # cap goes through the one decision (``used_up``: attempts >= max_attempts), not every row.
            if limit is not None and row.attempts - 1 >= limit:
                cap = after_failure(Unfinished(row.attempts - 1), row.attempts - 1, max_attempts=limit)
                if isinstance(cap, Bury):
                    dead.append((row.id, row.lock_token, cap.reason))
                    continue
            try:
                payload = self._decode(row.key, row.payload_type, row.payload)
            except SerializationMismatchError as exc:
                dead.append((row.id, row.lock_token, str(exc)))
                continue
            deliveries.append(
                Delivery(
                    row.id,
                    row.key,
                    payload,
                    row.attempts,
                    at(row.due_at),
                    at(row.scheduled_at_initially),
                    at(row.created_at),
                    at(row.locked_until),
                    row.lock_token,
                    self,
                    _tags=row.tags,
                    priority=row.priority,
                    group=row.group_key,
                    _worker_id=self._worker_id,
                )
            )
        if dead:
            log.warning("%s: %d claimed message(s) moved to the dead letters: %s", self.name, len(dead), dead[0][2])
            try:
                self._dead_letter_held(dead, using, worker=self._worker_id)
            except DBAPIError as exc:
                if using is not None and not isinstance(using, Engine):
                    raise  # the caller's transaction: theirs to handle
                # The good rows are delivered all the same; these stay locked and come back after
                # the visibility timeout, to be dead-lettered by that claim.
                log.warning("%s: could not move them now (%s)", self.name, type(exc.orig).__name__)
        return deliveries

    def attempt_history(self, key: str, *, using: Using = None) -> tuple[history.AttemptRecord, ...]:
        """The failed attempts of the message under ``key``, oldest first (empty when none, or no message)."""
        params = {"queue_name": self.name, "msg_key": check_key(key)}

        def op(conn: Connection, dialect: Dialect) -> tuple[history.AttemptRecord, ...]:
            stored = conn.execute(self._statements(dialect).memo(history_sql).history_of, params)
            return history.parse(stored.scalar())

        return self._runner.run(using, op, "read")

    def headers(self, key: str, *, using: Using = None) -> dict[str, str]:
        """The headers an offer stored with the message under ``key`` (the trace context, with tracing on)."""
        params = {"queue_name": self.name, "msg_key": check_key(key)}

        def op(conn: Connection, dialect: Dialect) -> dict[str, str]:
            stored = conn.execute(self._statements(dialect).memo(history_sql).headers_of, params)
            return history.load_headers(stored.scalar())

        return self._runner.run(using, op, "read")

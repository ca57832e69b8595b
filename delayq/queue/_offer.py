"""The offer path: validate and encode messages, and store them in single- and multi-row statements."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from sqlalchemy.engine import Connection

from delayq import history, observe
from delayq.dialects import Dialect, Statements
from delayq.dialects.base import NewRow
from delayq.messages import OfferOutcome
from delayq.queue._checks import At, _due, check_key
from delayq.queue._flow import _Flow, check_group, check_priority
from delayq.queue._history import statements as history_sql
from delayq.queue._lifecycle import check_unique_for, lifecycle_sql
from delayq.serializers import encode
from delayq.tags import encode_tags
from delayq.transactions import Using

OFFER_CHUNK = 500
"""Rows per multi-row INSERT in ``offer_many``."""

_Item = tuple[str, bytes, int | None, int | None]
"""An offered message, validated and encoded: (key, payload, due at in epoch ms, or due in ms from now)."""


class _Offers(_Flow):
    """``offer`` and ``offer_many`` of ``DelayedQueue``."""

    def offer(
        self,
        key: str,
        payload: Any,
        at: At = None,
        *,
        update: bool = False,
        priority: int = 0,
        group: str | None = None,
        unique_for: dt.timedelta | None = None,
        tags: Iterable[str] | None = None,
        using: Using = None,
    ) -> OfferOutcome:
        """Store a message due at ``at`` unless one with this key exists in the queue.

        With ``update=True`` an existing message is replaced (payload and due time; its
        attempts and error are reset, and a consumer's lock on it is cleared, so that
        consumer's ack deletes nothing). Replacing with identical content is ``IGNORED``;
        a relative ``at`` is measured from now, so it differs on every call.

        ``priority`` (from -1000 to 1000, default 0): claims take due messages of a higher priority
        first (docs/workers.md, "Priorities"); a replacement sets it too.
        ``group``: at most ``set_group_concurrency`` (1 by default) messages of one group are held at once,
        the earliest due first (docs/workers.md, "Groups"); a replacement sets it too (None: no group).
        ``tags``: up to ``delayq.tags.MAX_TAGS`` labels (lowercase letters, digits, ``- _ . : /``) kept with the
        message, its dead letter and its finished row; ``ls --tag`` and ``stats --tag`` filter on them (docs/workers.md,
        "Tags"); a replacement sets them too (None: none).
        ``unique_for`` (default: the queue's ``unique_for``): also ``IGNORED`` while a message under this key
        completed less than this long ago (kept: docs/lifecycle.md); ``update=True`` does not replace those.
        """
        unique_ms = self._unique_ms(unique_for)
        params = self._offer_params(key, payload, at)
        params["offer_priority"] = check_priority(priority)
        params["offer_group"] = check_group(group)
        stored_tags = encode_tags(tags)
        with observe.offering(self.name, 1) as headers:  # tracing's span, and its context to store

            def op(conn: Connection, dialect: Dialect) -> OfferOutcome:
                outcome = self._offer_one(conn, dialect, self._statements(dialect), params, update)
                if unique_ms is not None and outcome is not OfferOutcome.IGNORED:
                    new = outcome is OfferOutcome.CREATED
                    keys = [params["msg_key"]]
                    kept = self._unique(conn, dialect, keys if new else [], [] if new else keys, unique_ms)
                    outcome = outcome if kept else OfferOutcome.IGNORED
                if headers and outcome is not OfferOutcome.IGNORED:
                    self._store_headers(conn, dialect, [params["msg_key"]], headers)
                if stored_tags is not None and outcome is not OfferOutcome.IGNORED:
                    self._store_tags(conn, dialect, [params["msg_key"]], stored_tags)
                if outcome is not OfferOutcome.IGNORED:  # (a replacement set them: only the queue's mark)
                    created = [params["msg_key"]] if outcome is OfferOutcome.CREATED else []
                    if priority:
                        self._set_priorities(conn, dialect, created, priority)
                    if group is not None:
                        self._set_groups(conn, dialect, created, group)
                return outcome

            simple = not (
                update or headers or priority or group is not None or unique_ms is not None or stored_tags is not None
            )
            outcome = self._runner.run(using, op, "statement" if simple else "transaction")
        self._priorities_set(priority, using)
        self._groups_set(group, using)
        observe.count("offered", self.name, outcome is not OfferOutcome.IGNORED)
        return outcome

    def offer_many(
        self,
        items: Iterable[tuple[str, Any, At] | tuple[str, Any, At, Iterable[str] | None]],
        *,
        update: bool = False,
        priority: int = 0,
        group: str | None = None,
        unique_for: dt.timedelta | None = None,
        tags: Iterable[str] | None = None,
        using: Using = None,
    ) -> list[OfferOutcome]:
        """Offer ``(key, payload, at)`` items in multi-row statements; one outcome per item, in order.

        All items are validated first: a bad one raises before anything is written. A key
        that repeats within the batch is offered again after the first (so it is ``IGNORED``,
        or ``UPDATED`` with ``update=True``). ``priority``, ``group``, ``unique_for``, ``tags``: every item's (see
        ``offer``); an item ``(key, payload, at, tags)`` carries its own tags instead.
        """
        unique_ms = self._unique_ms(unique_for)
        check_priority(priority)
        check_group(group)
        shared_tags = encode_tags(tags)
        prepared: list[_Item] = []
        item_tags: list[str | None] = []
        for item in items:
            if len(item) == 4:
                key, payload, at, own = item
                item_tags.append(encode_tags(own))
            else:
                key, payload, at = item
                item_tags.append(shared_tags)
            prepared.append(self._item(key, payload, at))
        if not prepared:
            return []
        tagged = item_tags if any(t is not None for t in item_tags) else None
        with observe.offering(self.name, len(prepared)) as headers:
            found = self._offer_prepared(prepared, update, headers, using, priority, group, unique_ms, tagged)
        self._priorities_set(priority, using)
        self._groups_set(group, using)
        observe.count("offered", self.name, sum(o is not OfferOutcome.IGNORED for o in found))
        return found

    def _store_headers(self, conn: Connection, dialect: Dialect, keys: list[str], headers: dict[str, str]) -> None:
        """Keep ``headers`` with the messages just offered under ``keys``."""
        stmt = self._statements(dialect).memo(history_sql).set_headers
        conn.execute(stmt, {"queue_name": self.name, "keys": keys, "headers": history.dump_headers(headers)})

    def _store_tags(self, conn: Connection, dialect: Dialect, keys: list[str], stored: str | None) -> None:
        """Set the tags (their stored form) of the messages just offered under ``keys``."""
        stmt = self._statements(dialect).memo(history_sql).set_tags
        conn.execute(stmt, {"queue_name": self.name, "keys": keys, "tags": stored})

    def _offer_prepared(
        self,
        prepared: list[_Item],
        update: bool,
        headers: dict[str, str] | None,
        using: Using,
        priority: int = 0,
        group: str | None = None,
        unique_ms: int | None = None,
        item_tags: list[str | None] | None = None,
    ) -> list[OfferOutcome]:
        def op(conn: Connection, dialect: Dialect) -> list[OfferOutcome]:
            stmts = self._statements(dialect)
            now = self._now_ms(conn, stmts)
            outcomes: list[OfferOutcome | None] = [None] * len(prepared)
            keys = [key for key, *_ in prepared]
            first: dict[str, int] = {}
            for i, key in enumerate(keys):
                first.setdefault(key, i)
            firsts = list(first.values())
            queue, tag = self.name, self.serializer.type_tag
            for start in range(0, len(firsts), OFFER_CHUNK):
                chunk = firsts[start : start + OFFER_CHUNK]
                rows = [_new_row(queue, tag, prepared[i], now) for i in chunk]
                created = dialect.insert_many_if_absent(conn, stmts, queue, rows)
                for i in chunk:
                    if keys[i] in created:
                        outcomes[i] = OfferOutcome.CREATED
            for i, item in enumerate(prepared):
                if outcomes[i] is None:
                    outcomes[i] = (
                        self._offer_one(
                            conn,
                            dialect,
                            stmts,
                            {**self._item_params(item), "offer_priority": priority, "offer_group": group},
                            True,
                        )
                        if update
                        else OfferOutcome.IGNORED
                    )
            if unique_ms is not None:
                pairs = list(zip(keys, outcomes, strict=True))
                new = list(dict.fromkeys(k for k, o in pairs if o is OfferOutcome.CREATED))
                replaced = list(dict.fromkeys(k for k, o in pairs if o is OfferOutcome.UPDATED and k not in new))
                kept: set[str] = set()
                for start in range(0, max(len(new), len(replaced)), OFFER_CHUNK):
                    part = slice(start, start + OFFER_CHUNK)
                    kept.update(self._unique(conn, dialect, new[part], replaced[part], unique_ms))
                outcomes = [o if k in kept else OfferOutcome.IGNORED for k, o in pairs]
            if headers:
                done = [key for key, o in zip(keys, outcomes, strict=True) if o is not OfferOutcome.IGNORED]
                for start in range(0, len(done), OFFER_CHUNK):
                    self._store_headers(conn, dialect, done[start : start + OFFER_CHUNK], headers)
            if item_tags is not None:  # one UPDATE per distinct set of tags (and chunk) among the stored items
                by_tags: dict[str | None, list[str]] = {}
                for key, o, stored in zip(keys, outcomes, item_tags, strict=True):
                    if o is not OfferOutcome.IGNORED and stored is not None:
                        by_tags.setdefault(stored, []).append(key)
                for stored, tagged_keys in by_tags.items():
                    for start in range(0, len(tagged_keys), OFFER_CHUNK):
                        self._store_tags(conn, dialect, tagged_keys[start : start + OFFER_CHUNK], stored)
            if (priority or group is not None) and any(o is not OfferOutcome.IGNORED for o in outcomes):
                # the created ones (a replacement set them), and the queue's mark
                new_keys = [key for key, o in zip(keys, outcomes, strict=True) if o is OfferOutcome.CREATED]
                if priority:
                    self._set_priorities(conn, dialect, new_keys, priority)
                if group is not None:
                    self._set_groups(conn, dialect, new_keys, group)
            return [o for o in outcomes if o is not None]

        return self._runner.run(using, op, "transaction")

    def _unique_ms(self, unique_for: dt.timedelta | None) -> int | None:
        """The offer's ``unique_for`` in milliseconds, else the queue's; None: none."""
        return self.lifecycle.unique_for_ms if unique_for is None else check_unique_for(unique_for)

    def _unique(
        self, conn: Connection, dialect: Dialect, keys: list[str], replaced: list[str], unique_ms: int
    ) -> set[str]:
        """Of the keys just created, keep those not completed within ``unique_ms`` and undo the others' offers;
        mark the kept and the ``replaced`` ones (their ack keeps them that long). The keys kept.

        Checked after the insert, in a statement of its own: a completion that committed while the insert
        waited on its row (the message being acked) is seen by this fresh statement (READ COMMITTED), so
        the new message is undone rather than slipping in beside it.
        """
        ls = lifecycle_sql(self._statements(dialect), dialect)
        params = {"queue_name": self.name, "keys": keys, "unique_ms": unique_ms, **self._now_param()}
        done = set(conn.execute(ls.completed_since, params).scalars()) if keys else set()
        if done:
            conn.execute(ls.drop_offered, {**params, "keys": sorted(done)})
        kept = [k for k in keys if k not in done] + replaced
        if kept:
            conn.execute(ls.set_unique_for, {**params, "keys": kept})
        return set(kept)

    def _offer_params(self, key: str, payload: Any, at: At) -> dict[str, Any]:
        return self._item_params(self._item(key, payload, at))

    def _item(self, key: str, payload: Any, at: At) -> _Item:
        """An offered message validated and encoded; raises on bad input before anything is sent."""
        return check_key(key), encode(self.serializer, payload), *_due(at)

    def _item_params(self, item: _Item) -> dict[str, Any]:
        """The parameters of the one-message offer statements for a validated item."""
        key, payload, due_at, due_in = item
        return {
            "queue_name": self.name,
            "msg_key": key,
            "payload": payload,
            "payload_type": self.serializer.type_tag,
            "due_at": due_at,
            "due_in": due_in,
            **self._now_param(),
        }

    def _offer_one(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any], update: bool
    ) -> OfferOutcome:
        while True:
            if dialect.insert_if_absent(conn, stmts, params):
                return OfferOutcome.CREATED
            if not update:
                return OfferOutcome.IGNORED
            row = conn.execute(stmts.lock_for_update, params).first()
            if row is None:
                continue  # a consumer acked it since the insert: offer it afresh
            due = params["due_at"] if params["due_at"] is not None else row.now + params["due_in"]
            if (
                bytes(row.payload) == params["payload"]
                and row.payload_type == params["payload_type"]
                and row.scheduled_at_initially == due
            ):
                return OfferOutcome.IGNORED
            swapped = conn.execute(
                stmts.replace,
                {
                    "msg_id": row.id,
                    "old_scheduled_at_initially": row.scheduled_at_initially,
                    "old_created_at": row.created_at,
                    "payload": params["payload"],
                    "payload_type": params["payload_type"],
                    "new_scheduled_at": due,
                    "new_created_at": row.now,
                    "new_priority": params.get("offer_priority", 0),
                    "new_group": params.get("offer_group"),
                },
            ).rowcount
            if swapped == 1:
                if stmts.notify is not None:
                    conn.execute(stmts.notify, params)
                return OfferOutcome.UPDATED


def _new_row(queue: str, payload_type: str, item: _Item, now: int) -> NewRow:
    key, payload, due_at, due_in = item
    due = due_at if due_at is not None else now + (due_in or 0)
    return (queue, key, payload, payload_type, due, due, now, 0)

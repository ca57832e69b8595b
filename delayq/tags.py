"""Tags: short labels an offer attaches to a message, kept with it as it moves (dead letters, finished rows).

A message's tags are stored in one text column as ``,a,b,`` (sorted, each once), so that "has tag t" is
``tags LIKE '%,t,%'`` on every backend, served by no index (a filter over the rows a query reads anyway).
A tag is 1 to ``MAX_TAG_LENGTH`` of lowercase ASCII letters, digits and ``- _ . : /``: lowercase only, since
MySQL/MariaDB and SQLite compare LIKE without case; ``_`` is escaped in patterns (``tag_pattern``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from delayq.errors import InvalidInputError

MAX_TAGS = 10
"""The most tags one message may carry."""
MAX_TAG_LENGTH = 50
"""The longest tag, in characters."""
LIKE_ESCAPE = "!"
"""The escape character of ``tag_pattern`` (no tag holds one)."""

_TAG = re.compile(r"[a-z0-9_.:/-]+")


def check_tag(tag: object) -> str:
    """Return ``tag`` if it is a valid tag, else raise ``InvalidInputError``."""
    if not isinstance(tag, str):
        raise InvalidInputError(f"a tag must be a str, got {type(tag).__name__}")
    if not tag or len(tag) > MAX_TAG_LENGTH or not _TAG.fullmatch(tag):
        raise InvalidInputError(
            f"tag {tag[:60]!r} must be 1 to {MAX_TAG_LENGTH} lowercase letters, digits, or - _ . : /"
        )
    return tag


def encode_tags(tags: Iterable[str] | None) -> str | None:
    """The stored form of ``tags`` (``,a,b,``: sorted, each once), None for none; raises on bad input."""
    if tags is None:
        return None
    if isinstance(tags, str | bytes):
        raise InvalidInputError(f"tags must be a list of str, not one {type(tags).__name__}: {tags[:60]!r}")
    try:
        found = sorted({check_tag(t) for t in tags})
    except TypeError:
        raise InvalidInputError(f"tags must be a list of str, got {type(tags).__name__}") from None
    if len(found) > MAX_TAGS:
        raise InvalidInputError(f"a message carries at most {MAX_TAGS} tags, got {len(found)}")
    return "," + ",".join(found) + "," if found else None


def decode_tags(stored: str | None) -> tuple[str, ...]:
    """The tags of a stored ``,a,b,`` value (empty for NULL)."""
    if not stored:
        return ()
    return tuple(t for t in stored.split(",") if t)


def tag_pattern(tag: str) -> str:
    """The LIKE pattern (escaped with ``LIKE_ESCAPE``) matching stored tags that hold ``tag``; raises on a bad tag."""
    return "%," + check_tag(tag).replace("_", LIKE_ESCAPE + "_") + ",%"

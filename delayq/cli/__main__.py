"""``python -m delayq.cli``: the ``delayq`` command."""

from __future__ import annotations

if __name__ == "__main__":
    from delayq.cli import main

    main()

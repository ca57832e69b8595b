"""The command line's answer to bad input: an error line and exit code 2 (or a usage error), never a traceback.

Every command of the ``delayq`` tree (walked from click's own objects, so a new command is fuzzed without a
change here) takes the fuzz set of tests/test_web_fuzz.py in each of its arguments and options in turn, the
others at a valid baseline, on every backend (full profile). Commands that serve until stopped (``worker``,
``web``, ``top``), the demo and ``migrate`` are left out, and so are options that only pace a wait.
"""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner, Result
from conftest import Backend
from test_web_fuzz import FUZZ

from delayq import DelayedQueue
from delayq.cli import main

pytestmark = pytest.mark.slow

LEFT_OUT = {"worker", "web", "top", "demo", "migrate"}
"""Commands that run until stopped, or change the schema."""
PACING = {"timeout", "interval", "times", "watch", "wait"}
"""Options that pace a wait (a huge value would only make the test wait)."""
EXIT_CODES = {0, 1, 2}
"""0 done, 1 nothing found where the command documents it, 2 bad input or an unusable database (click's usage errors
too)."""


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name, command in sorted(group.commands.items()):
        if not path and name in LEFT_OUT:
            continue
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def _baseline(param: click.Parameter, queue: str) -> str:
    name = (param.name or "").lower()
    return {"queue": queue, "key": "k-1", "payload": "{}", "topic": "t-fuzz", "group": "g"}.get(name, "x")


def _argv(command: click.Command, queue: str, fuzzed: click.Parameter | None, value: str) -> list[str]:
    argv: list[str] = []
    for p in command.params:
        if isinstance(p, click.Argument):
            if p is fuzzed:
                argv.append(value)
            elif p.required:
                argv.append(_baseline(p, queue))
        elif isinstance(p, click.Option) and p is fuzzed:
            argv += [p.opts[0], value]
    return argv


def _fuzzable(p: click.Parameter) -> bool:
    if isinstance(p, click.Option) and (p.is_flag or p.count or p.hidden):
        return False
    return (p.name or "") not in PACING


def test_every_command_answers_every_fuzzed_argument_with_an_error_line(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("k-1", {"n": 1})
    runner = CliRunner()
    commands = list(_commands(main))
    assert any(path == ("ls",) for path, _ in commands)
    failures: dict[str, str] = {}  # (the first failure of each command's parameter: all of them in one run)
    for path, command in commands:
        for param in [p for p in command.params if _fuzzable(p)]:
            for value in FUZZ:
                args = ["--url", backend.url, *path, *_argv(command, queue_name, param, value)]
                if "--yes" in {o for p in command.params if isinstance(p, click.Option) for o in p.opts}:
                    args.append("--yes")
                result = runner.invoke(main, args, input="n\n", catch_exceptions=True)
                where = f"delayq {' '.join(path)} {param.name}={value!r:.60}"
                problem = _problem(result)
                if problem is not None:
                    failures.setdefault(f"{' '.join(path)} {param.name}", f"{where}: {problem}")
    assert not failures, "\n".join(failures.values())


def _problem(result: Result) -> str | None:
    """What is wrong with a command's answer to bad input, or None."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"{type(result.exception).__name__}: {str(result.exception)[:300]}"
    if result.exit_code not in EXIT_CODES or "Traceback" in result.output:
        return f"exit {result.exit_code}: {result.output[-300:]}"
    if result.exit_code == 2 and "Error" not in result.output:
        return f"exit 2 without an error line: {result.output[-300:]}"
    return None

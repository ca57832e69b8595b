"""The delayq command on every backend (click's runner), and as a real process for demo."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import Backend

from delayq import DelayedQueue
from delayq.cli import main


def cli(backend: Backend, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, ["--url", backend.url, *args], input=input, catch_exceptions=False)


@pytest.fixture
def filled(backend: Backend, queue_name: str) -> DelayedQueue:
    """ready-2 ready, ready-1 in flight, later scheduled, dead-1 and dead-2 dead."""
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(k, {"k": k}, None) for k in ("ready-1", "ready-2", "dead-1", "dead-2")])
    q.offer("later", {"k": "later"}, at=dt.timedelta(hours=1))
    held = {d.key: d for d in q.try_poll_many(10)}
    assert held["dead-1"].dead_letter("bad") and held["dead-2"].dead_letter("bad")
    assert q.release([held["ready-2"]]) == 1
    return q


def test_stats_and_ls(backend: Backend, filled: DelayedQueue) -> None:
    out = cli(backend, "stats", filled.name, "--json")
    assert out.exit_code == 0, out.output
    [row] = json.loads(out.output)
    assert (row["ready"], row["scheduled"], row["in_flight"], row["dead"]) == (1, 1, 1, 2)
    assert filled.name in cli(backend, "stats").output
    assert cli(backend, "stats", filled.name, "--watch", "--times", "2", "--interval", "0").exit_code == 0

    ls = json.loads(cli(backend, "ls", filled.name, "--json").output)
    assert [(m["key"], m["state"]) for m in ls] == [
        ("ready-2", "ready"),
        ("ready-1", "in-flight"),
        ("later", "scheduled"),
    ]
    assert [m["key"] for m in json.loads(cli(backend, "ls", filled.name, "--state", "dead", "--json").output)] == [
        "dead-1",
        "dead-2",
    ]
    assert [
        m["key"]
        for m in json.loads(cli(backend, "ls", filled.name, "--key-prefix", "ready", "--limit", "1", "--json").output)
    ] == ["ready-2"]
    table = cli(backend, "ls", filled.name).output
    assert "KEY" in table and "ready-2" in table


def test_show_reschedule_run_now_cancel(backend: Backend, filled: DelayedQueue) -> None:
    shown = json.loads(cli(backend, "show", filled.name, "ready-2", "--json").output)
    assert shown[0]["payload"] == {"k": "ready-2"}
    assert cli(backend, "reschedule", filled.name, "ready-2", "--in", "1h30m").exit_code == 0
    assert filled.stats().scheduled == 2
    assert cli(backend, "reschedule", filled.name, "ready-2", "--at", "2099-01-01T00:00:00+00:00").exit_code == 0
    assert filled.get("ready-2").scheduled_at.year == 2099
    assert cli(backend, "run-now", filled.name, "later").exit_code == 0
    assert filled.stats().ready == 1
    assert cli(backend, "cancel", filled.name, "later").exit_code == 0
    assert filled.get("later") is None


def test_cancel_says_which_it_did(backend: Backend, filled: DelayedQueue) -> None:
    """ready-1 is held (its lock unexpired): running; later is queued; a third cancel finds nothing."""
    running = cli(backend, "cancel", filled.name, "ready-1")
    assert (
        running.exit_code == 0
        and running.output == f"{filled.name}: cancelled running message ready-1: its worker is told\n"
    )
    queued = cli(backend, "cancel", filled.name, "later")
    assert queued.exit_code == 0 and queued.output == f"{filled.name}: cancelled queued message later\n"
    gone = cli(backend, "cancel", filled.name, "later")
    assert gone.exit_code == 2 and "no message 'later'" in gone.output


def test_ls_and_stats_filter_by_tag(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([("a", 1, None, ["eu"]), ("b", 2, None, ["eu", "vip"]), ("c", 3, None, ["us"])])
    assert cli(backend, "enqueue", queue_name, "d", "4").exit_code == 0
    assert cli(backend, "enqueue", queue_name, "e", "5", "--in", "1h", "--tag", "vip", "--tag", "eu").exit_code == 0
    message = q.get("e")
    assert message is not None and message.tags == ("eu", "vip")
    assert q.try_poll_many(10)[0].dead_letter("bad")  # a, the first due: a dead letter tagged eu
    listed = json.loads(cli(backend, "ls", queue_name, "--tag", "eu", "--json").output)
    assert [(m["key"], m["tags"]) for m in listed] == [("b", ["eu", "vip"]), ("e", ["eu", "vip"])]
    dead = json.loads(cli(backend, "ls", queue_name, "--state", "dead", "--tag", "eu", "--json").output)
    assert [m["key"] for m in dead] == ["a"]
    assert "eu,vip" in cli(backend, "ls", queue_name).output  # a tags column, as some message has tags
    [row] = json.loads(cli(backend, "stats", queue_name, "--tag", "eu", "--json").output)
    assert (row["ready"], row["in_flight"], row["scheduled"], row["dead"]) == (0, 1, 1, 1)
    [row] = json.loads(cli(backend, "stats", queue_name, "--tag", "none", "--json").output)
    assert (row["ready"], row["in_flight"], row["dead"]) == (0, 0, 0)
    bad = cli(backend, "stats", queue_name, "--tag", "EU")
    assert bad.exit_code == 2 and "lowercase" in bad.output and len(bad.output.strip().splitlines()) == 1


def test_dead_requeue_and_purge(backend: Backend, filled: DelayedQueue) -> None:
    declined = cli(backend, "dead", "requeue", filled.name, "--key", "dead-1", input="n\n")
    assert declined.exit_code == 1 and filled.stats().dead == 2
    assert cli(backend, "dead", "requeue", filled.name, "--key", "dead-1", input="y\n").exit_code == 0
    assert filled.get("dead-1") is not None
    out = cli(backend, "dead", "purge", filled.name, "--all", "--yes")
    assert out.exit_code == 0 and "1 dead letter(s) purged" in out.output
    assert filled.stats().dead == 0


def test_cron_ls(backend: Backend, queue_name: str) -> None:
    from delayq import CronService

    cron = CronService(DelayedQueue(backend.engine, queue_name))
    schedule = cron.install_cron("nightly", "0 3 * * *", tz="Europe/Berlin")
    rows = json.loads(cli(backend, "cron", "ls", "--queue", queue_name, "--json").output)
    assert [(r["prefix"], r["config"], len(r["next_due"])) for r in rows] == [("nightly", schedule.config_hash, 3)]


@pytest.mark.parametrize(
    "args",
    [
        ["show", "no-such-queue", "k"],
        ["show", "{queue}", "no-such-key"],
        ["reschedule", "{queue}", "ready-2", "--in", "soon"],
        ["reschedule", "{queue}", "ready-2", "--at", "2030-01-01T09:00"],
        ["reschedule", "{queue}", "ready-2"],
        ["cancel", "{queue}", "no-such-key"],
        ["dead", "purge", "{queue}"],
        ["worker", "no_such_module:handlers"],
    ],
)
def test_bad_input_says_what_to_do_in_one_line(backend: Backend, filled: DelayedQueue, args: list[str]) -> None:
    out = cli(backend, *[a.format(queue=filled.name) for a in args])
    assert out.exit_code == 2, out.output
    assert "Traceback" not in out.output
    assert len([line for line in out.output.splitlines() if line.startswith("Error")]) == 1, out.output


@pytest.mark.parametrize(
    "url", ["nonsense", "postgresql+psycopg://nobody@127.0.0.1:1/none", "oracle+oracledb://u:p@localhost/x"]
)
def test_bad_or_unreachable_databases(url: str) -> None:
    out = CliRunner().invoke(main, ["--url", url, "stats"])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert out.output.startswith("Error: "), out.output


def test_missing_tables(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["--url", f"sqlite:///{tmp_path / 'empty.db'}", "ls", "q"])
    assert out.exit_code == 2 and "delayq migrate" in out.output, out.output


@pytest.mark.slow  # (subprocesses: the full profile; the fast one stays under 8 minutes)
def test_demo_runs_as_a_process_and_leaves_a_database_to_look_at(tmp_path: Path) -> None:
    from conftest import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k != "DELAYQ_URL"}
    env["PYTHONPATH"] = str(REPO_ROOT)  # this tree's delayq, wherever the environment's own install points
    run = [sys.executable, "-m", "delayq.cli"]
    done = subprocess.run(
        [*run, "demo", "--seconds", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # it runs until every email is settled, however short --seconds and however loaded the machine
    assert "summary: 10 emails sent, 5 failed attempts retried, 2 dead letters" in done.stdout, done.stdout
    assert "0 emails still queued" in done.stdout and "the rest already queued" not in done.stdout
    assert "email-10: no address after 1 attempt\n" in done.stdout and "email-7" in done.stdout
    assert (tmp_path / "delayq.db").exists()
    stats = subprocess.run([*run, "stats", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert {r["queue"] for r in json.loads(stats.stdout)} == {"demo-emails"}  # (its schedule is uninstalled)
    listed = subprocess.run(
        [*run, "ls", "demo-emails", "--state", "dead"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert "email-7" in listed.stdout and "email-10" in listed.stdout
    # The next steps it prints run as written, in a shell, from where the demo ran.
    steps = done.stdout.split("next, to look at what it left in the database:\n", 1)[1].splitlines()
    assert steps[0].endswith(" stats"), done.stdout
    shown = subprocess.run(steps[0].strip(), shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "demo-emails" in shown.stdout, steps[0] + shown.stdout + shown.stderr


def test_after_scripts_demo_the_next_steps_are_those_the_readme_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import REPO_ROOT

    from delayq.demo import next_steps

    bin_dir = tmp_path / ".venv" / "bin"  # what scripts/demo runs: `exec .venv/bin/delayq demo` from the root
    bin_dir.mkdir(parents=True)
    (bin_dir / "delayq").write_text("")
    (bin_dir / "activate").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [".venv/bin/delayq", "demo"])
    monkeypatch.setenv("PATH", "/nonexistent")
    steps = next_steps("sqlite:///delayq.db").splitlines()
    assert steps[0] == "  .venv/bin/delayq stats"
    assert steps[-1] == "(this delayq is not on your PATH: `source .venv/bin/activate` puts it there)"
    readme = (REPO_ROOT / "README.md").read_text()
    assert "`.venv/bin/delayq stats`" in readme and "`source .venv/bin/activate`" in readme


def test_printed_urls_mask_every_password(tmp_path: Path) -> None:
    from delayq.cli import shown_url

    url = "postgresql+psycopg://u:s3cret@db.example/app?password=q5ecret&sslpassword=k3y&application_name=x"
    shown = shown_url(url)
    assert "s3cret" not in shown and "q5ecret" not in shown and "k3y" not in shown
    assert "application_name=x" in shown


def test_a_password_with_an_unencoded_at_is_refused_without_echoing_it() -> None:
    result = CliRunner().invoke(main, ["--url", "postgresql+psycopg://u:pa@ss@db.example/app", "stats"])
    assert result.exit_code == 2
    assert "%40" in result.output and "ss@db" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "worker_app:handlers", "--shutdown-timeout", "-5"],
        ["reschedule", "q", "k", "--in", "99999999999d"],
    ],
)
def test_out_of_range_options_get_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--url", f"sqlite:///{tmp_path / 'x.db'}", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_url_and_prefix_may_follow_the_subcommand_as_the_docs_write_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'after.db'}"
    result = CliRunner().invoke(main, ["migrate", "--url", url])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "after.db").exists()
    result = CliRunner().invoke(main, ["stats", f"--url={url}", "--json"])
    assert result.exit_code == 0, result.output


def test_version_names_the_installed_one() -> None:
    assert CliRunner().invoke(main, ["--version"]).output.startswith("delayq, version")
    # (a postgres:// URL is psycopg's: tests/test_cli_consistency.py)


def test_stats_of_a_drained_queue_is_zeros_not_an_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'drained.db'}"
    assert CliRunner().invoke(main, ["--url", url, "migrate"]).exit_code == 0
    result = CliRunner().invoke(main, ["--url", url, "stats", "slow", "--json"])
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.output)
    assert row["queue"] == "slow" and row["ready"] == 0


@pytest.mark.parametrize(
    ("module", "source", "says"),
    [
        ("failing_at_import", "raise RuntimeError('boom at import')\n", "RuntimeError: boom at import (at "),
        ("broken_syntax", "def (\n", "invalid syntax at "),
    ],
)
def test_a_handler_module_that_fails_to_import_is_one_line_saying_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str, says: str
) -> None:
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["--url", f"sqlite:///{tmp_path / 'x.db'}", "worker", f"{module}:handlers"])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output


def test_a_url_with_a_port_that_is_no_number_is_one_line() -> None:
    result = CliRunner().invoke(main, ["--url", "postgresql+psycopg://u@db.example:abc/app", "stats"])
    assert result.exit_code == 2 and "bad database URL" in result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prefix", "p" * 59, "migrate"], "at most 38"),
        (["--prefix", "bad-prefix", "migrate"], "letters, digits and underscores"),
    ],
)
def test_a_prefix_the_database_cannot_name_tables_with_is_refused(tmp_path: Path, args: list[str], says: str) -> None:
    result = CliRunner().invoke(main, ["--url", f"sqlite:///{tmp_path / 'x.db'}", *args])
    assert result.exit_code == 2 and says in result.output


def test_a_schema_that_is_not_there_is_one_line(postgres: Backend) -> None:
    result = CliRunner().invoke(main, ["--url", postgres.url, "migrate", "--schema", "no_such_schema_here"])
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output


# -- issue 19: the operator's command line --------------------------------------------------------------
def test_enqueue_offers_json_now_at_or_in(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    assert cli(backend, "enqueue", queue_name, "now", '{"a": 1}').output.strip() == f"{queue_name} now: created"
    assert cli(backend, "enqueue", queue_name, "now", '{"a": 2}').output.strip() == f"{queue_name} now: ignored"
    assert cli(backend, "enqueue", queue_name, "now", '"b"', "--update").output.strip().endswith("updated")
    assert cli(backend, "enqueue", queue_name, "later", "[1]", "--in", "1h30m").exit_code == 0
    assert cli(backend, "enqueue", queue_name, "fixed", "null", "--at", "2099-01-01T00:00:00+00:00").exit_code == 0
    assert q.get("now").payload == "b"  # type: ignore[union-attr]
    assert q.get("fixed").scheduled_at.year == 2099  # type: ignore[union-attr]
    stats = q.stats()
    assert (stats.ready, stats.scheduled) == (1, 2)
    for bad in (["x", "not json"], ["x", "1", "--at", "2099-01-01T00:00+00:00", "--in", "5m"], ["x", "1", "--in", "?"]):
        out = cli(backend, "enqueue", queue_name, *bad)
        assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert q.get("x") is None


def test_cancel_by_key_prefix_counts_asks_and_cancels_in_batches_as_cancel_matching(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import click._termui_impl

    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"user-1-{i}", i, None) for i in range(5)] + [("user-10", 0, None), ("other", 0, None)])
    declined = cli(backend, "cancel", queue_name, "--key-prefix", "user-1-", input="n\n")
    assert declined.exit_code == 1 and q.stats().ready == 7
    # The bulk cancel of --tag and --state (each running message recorded and told: test_bulk.py), here in
    # batches of two, the bar drawn as on a terminal.
    monkeypatch.setattr(click._termui_impl, "isatty", lambda _: True)
    calls: list[dict[str, Any]] = []
    cancel_matching = DelayedQueue.cancel_matching

    def in_twos(self: DelayedQueue, **kwargs: Any) -> Any:
        calls.append({k: v for k, v in kwargs.items() if k != "progress"})
        return cancel_matching(self, **{**kwargs, "batch_size": 2})

    monkeypatch.setattr(DelayedQueue, "cancel_matching", in_twos)
    done = cli(backend, "cancel", queue_name, "--key-prefix", "user-1-", input="y\n")
    assert done.exit_code == 0 and f"{queue_name}: 5 message(s) cancelled" in done.stdout, done.output
    assert f"cancel 5 message(s) of {queue_name!r} whose key starts with 'user-1-'?" in done.output
    assert calls == [{"state": None, "key_prefix": "user-1-", "tag": None}]
    bar = "".join(done.stderr.split("\r"))
    assert [f"{i}/5" in bar for i in (0, 2, 4, 5)] == [True] * 4, done.stderr
    assert "cancel  [####################################]  5/5" in done.stderr, done.stderr
    assert q.get("user-10") is not None and q.get("other") is not None and q.stats().ready == 2
    assert cli(backend, "cancel", queue_name, "--key-prefix", "user", "--yes").exit_code == 0
    assert len(calls) == 2 and q.stats().ready == 1
    for bad in ([], ["other", "--key-prefix", "o"], ["--key-prefix", "none-such", "--yes"]):
        out = cli(backend, "cancel", queue_name, *bad)
        assert out.exit_code == 2, out.output
    assert "no message of queue" in out.output and q.stats().ready == 1


def test_prefix_chunks_cover_every_key_once_and_hold_at_most_the_chunk() -> None:
    from delayq.cli import prefix_chunks

    keys = sorted({f"job-{n * 7919 % 10007}" for n in range(3000)} | {"job-", "job-1", "job-12"})
    chunks = list(prefix_chunks("job-", keys, 100))
    covered: list[str] = []
    for sub, exact, n in chunks:
        under = [k for k in keys if (k == sub if exact else k.startswith(sub))]
        assert len(under) == n <= 100
        covered += under
    assert sorted(covered) == keys and len(chunks) < len(keys) / 10


def test_ls_states_match_stats_expired_locks_included(backend: Backend, queue_name: str) -> None:
    from delayq import ManualClock

    q = DelayedQueue(backend.engine, queue_name)
    q.offer("held", 1)
    assert q.try_poll() is not None  # locked for 5 minutes
    q.offer("expired", 2, at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    long_ago = DelayedQueue(backend.engine, queue_name, clock=ManualClock(dt.datetime(2001, 1, 1, tzinfo=dt.UTC)))
    assert long_ago.try_poll() is not None  # locked until 2001: an expired lock now
    q.offer("ready", 3)
    q.offer("later", 4, at=dt.timedelta(hours=1))
    stats = q.stats()
    assert (stats.ready, stats.scheduled, stats.in_flight, stats.expired_locks) == (1, 1, 1, 1)
    listed = {m["key"]: m["state"] for m in json.loads(cli(backend, "ls", queue_name, "--json").output)}
    assert listed == {"held": "in-flight", "expired": "expired-lock", "ready": "ready", "later": "scheduled"}
    only = json.loads(cli(backend, "ls", queue_name, "--state", "expired-lock", "--json").output)
    assert [m["key"] for m in only] == ["expired"]
    table = cli(backend, "ls", queue_name).output
    assert "in 59m" in table or "in 1h 00m" in table  # human durations, not 0:59:59.998


def test_show_ls_and_dead_letters_carry_the_attempt_history(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("img", 1)
    for attempt in (1, 2):
        d = q.try_poll()
        assert d is not None
        try:
            raise OSError(f"storage hiccup {attempt}")
        except OSError as exc:
            assert (d.retry(error=f"OSError: {exc}") if attempt == 1 else d.dead_letter(f"OSError: {exc}")) is True
    [dead] = json.loads(cli(backend, "ls", queue_name, "--state", "dead", "--json").output)
    assert dead["failed_at"] is not None
    assert [(r["attempt"], r["error_type"]) for r in dead["attempt_history"]] == [(1, "OSError"), (2, "OSError")]
    assert "in test_show_ls_and_dead_letters_carry_the_attempt_history" in dead["attempt_history"][1]["traceback"]
    shown = cli(backend, "show", queue_name, "img").output
    assert "failed_at" in shown and "attempt 2 failed" in shown and "OSError: storage hiccup 2" in shown
    assert "Traceback (most recent call last)" in shown
    assert "failed" in cli(backend, "ls", queue_name, "--state", "dead").output.splitlines()[0].lower()


@pytest.mark.parametrize("command", [["stats"], ["stats", "q"], ["ls", "q"], ["show", "q", "k"], ["cron", "ls"]])
def test_read_only_commands_never_create_a_database_file(tmp_path: Path, command: list[str]) -> None:
    result = CliRunner().invoke(main, ["--url", f"sqlite:///{tmp_path / 'none.db'}", *command])
    assert result.exit_code == 2 and "delayq migrate" in result.output, result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql+asyncpg://u@127.0.0.1/app", "postgresql+psycopg://"),
        ("sqlite+aiosqlite:///x.db", "sqlite:///"),
        ("mysql+asyncmy://u@127.0.0.1/app", "mysql+mysqldb://"),
    ],
)
def test_asyncio_driver_urls_get_the_synchronous_spelling(url: str, says: str) -> None:
    result = CliRunner().invoke(main, ["--url", url, "stats"])
    assert result.exit_code == 2 and "asyncio driver" in result.output and says in result.output, result.output


def test_worker_options_fail_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    verbose = CliRunner().invoke(main, ["--url", url, "worker", "m:h", "--log-level", "verbose"])
    assert verbose.exit_code == 2 and "Traceback" not in verbose.output and "debug" in verbose.output
    asyncpg = CliRunner().invoke(
        main, ["--url", "postgresql+asyncpg://u@127.0.0.1/x", "worker", "test_metrics:handlers"]
    )
    assert asyncpg.exit_code == 2 and "asyncio driver" in asyncpg.output, asyncpg.output


def test_durations_read_as_people_write_them() -> None:
    from delayq.humanize import human

    cases = {0.85: "850ms", 2.185043: "2.2s", 303: "5m 03s", 5400: "1h 30m", 187_200: "2d 4h"}
    assert {s: human(dt.timedelta(seconds=s)) for s in cases} == cases


def test_colour_only_on_a_terminal(backend: Backend, filled: DelayedQueue) -> None:
    plain = CliRunner().invoke(main, ["--url", backend.url, "ls", filled.name])
    coloured = CliRunner().invoke(main, ["--url", backend.url, "ls", filled.name], color=True)
    assert "\x1b[" not in plain.output and "\x1b[32mready" in coloured.output


def test_a_drained_queue_lists_nothing_and_a_scheduled_one_stays_in_stats(backend: Backend, queue_name: str) -> None:
    from delayq import CronService
    from delayq.cron.schedule import NAMESPACE

    q = DelayedQueue(backend.engine, queue_name)
    q.offer("once", 1)
    delivery = q.try_poll()
    assert delivery is not None and delivery.ack()  # drained: no message, no dead letter, no schedule
    listed = cli(backend, "ls", queue_name)
    assert listed.exit_code == 0 and listed.stdout.strip() == "(nothing)", listed.output
    assert f"queue {queue_name!r} has no messages, dead letters or cron schedule" in listed.stderr
    as_json = cli(backend, "ls", queue_name, "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == [] and as_json.stderr == ""
    [row] = json.loads(cli(backend, "stats", queue_name, "--json").stdout)
    assert (row["queue"], row["ready"], row["dead"]) == (queue_name, 0, 0)
    shown = cli(backend, "show", queue_name, "once")
    assert shown.exit_code == 2 and "no message 'once'" in shown.output and "has no messages" in shown.output

    # A queue with a cron schedule is known while it has no message at all (its runs cancelled here).
    ticks = DelayedQueue(backend.engine, f"{queue_name}-ticks")
    CronService(ticks).install_periodic("tick", every=dt.timedelta(hours=1))
    assert ticks.cancel_prefix(NAMESPACE) > 0 and ticks.stats().scheduled == 0
    everything = {r["queue"]: r for r in json.loads(cli(backend, "stats", "--json").stdout)}
    assert everything[ticks.name]["scheduled"] == 0 and everything[ticks.name]["ready"] == 0
    assert queue_name not in everything  # nothing at all: as a queue never used (named, it shows zeros)
    listed = cli(backend, "ls", ticks.name)
    assert listed.exit_code == 0 and listed.stderr == "", listed.output


@pytest.mark.parametrize("installed", [False, True], ids=["without-driver", "with-driver"])
@pytest.mark.parametrize(
    ("url", "module", "tested"),
    [
        ("postgresql+psycopg2://u@127.0.0.1:1/app", "psycopg2", "postgresql+psycopg://"),
        ("mysql+pymysql://u@127.0.0.1:1/app", "pymysql", "mysql+mysqldb://"),
    ],
)
def test_urls_of_drivers_delayq_is_not_tested_on_get_the_hint(
    url: str, module: str, tested: str, installed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from delayq.cli import DRIVER_HINTS

    really = importlib.util.find_spec(module) is not None
    if not installed:
        monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    elif not really:
        monkeypatch.setattr("delayq.cli._common._importable", lambda _: True)  # as if it were
    result = CliRunner().invoke(main, ["--url", url, "stats"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    if not installed:
        assert f"the database driver is not installed ({module}): {DRIVER_HINTS[module]}" in result.output
        assert tested in result.output
    else:
        assert f"uses {module}, which delayq is not tested on: it is on {tested}" in result.stderr, result.output
        assert result.stderr.count("note:") == 1


# -- delayq worker --driver asyncio ------------------------------------------------------------------------
def test_worker_driver_and_handler_mismatches_fail_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mixed_app.py").write_text(
        "from delayq import Handler\nfrom delayq.aio import AsyncHandler\n"
        "class Plain(Handler):\n    queue = 'p'\n    def handle(self, d, conn=None): pass\n"
        "class Coro(AsyncHandler):\n    queue = 'c'\n    async def handle(self, d, conn=None): pass\n"
        "plain = [Plain]\ncoro = [Coro]\n"
    )
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'x.db'}"
    cases = {
        ("mixed_app:plain", "asyncio"): "Plain.handle is a plain def: --driver asyncio needs",
        ("mixed_app:coro", "threads"): "Coro.handle is a coroutine (async def): run it with --driver asyncio",
        ("mixed_app:plain", "fibers"): "'fibers' is not one of 'threads', 'asyncio'",
    }
    for (spec, driver), says in cases.items():
        result = CliRunner().invoke(main, ["--url", url, "worker", spec, "--driver", driver])
        assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output
    asyncpg = CliRunner().invoke(main, ["--url", "postgresql+asyncpg://u@127.0.0.1/x", "worker", "mixed_app:plain"])
    assert asyncpg.exit_code == 2 and "or run the worker with --driver asyncio" in asyncpg.output, asyncpg.output


def test_the_asyncio_driver_uses_the_databases_asyncio_driver() -> None:
    from delayq.engines import async_url, sync_url

    cases = {
        "sqlite:///x.db": "sqlite+aiosqlite:///x.db",
        "postgresql://u@h/d": "postgresql+psycopg://u@h/d",
        "postgresql+psycopg://u@h/d": "postgresql+psycopg://u@h/d",
        "postgresql+asyncpg://u@h/d": "postgresql+asyncpg://u@h/d",
        "mysql+mysqldb://r@h/d": "mysql+asyncmy://r@h/d",
        "mariadb://r@h/d": "mariadb+asyncmy://r@h/d",
        "mysql+aiomysql://r@h/d": "mysql+aiomysql://r@h/d",
    }
    assert {u: async_url(u).render_as_string() for u in cases} == cases
    back = {  # the sync driver the asyncio worker's metrics read the gauges through
        "sqlite+aiosqlite:///x.db": "sqlite+pysqlite:///x.db",
        "postgresql+asyncpg://u@h/d": "postgresql+psycopg://u@h/d",
        "mysql+asyncmy://r@h/d": "mysql+mysqldb://r@h/d",
        "postgresql+psycopg://u@h/d": "postgresql+psycopg://u@h/d",
    }
    assert {u: sync_url(u).render_as_string() for u in back} == back


def test_an_asyncio_worker_without_the_tables_exits_with_the_migrate_hint(backend: Backend) -> None:
    result = CliRunner().invoke(
        main, ["--url", backend.url, "--prefix", "nosuch_", "worker", "test_cli:coro_handlers", "--driver", "asyncio"]
    )
    assert result.exit_code == 2 and "delayq migrate" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("asyncpg", [False, True], ids=["url-driver", "asyncpg-url"])
def test_an_asyncio_worker_process_handles_and_stops_on_sigterm(
    backend: Backend, queue_name: str, tmp_path: Path, asyncpg: bool
) -> None:
    import signal

    import sqlalchemy as sa
    from test_worker import wait_until

    url = backend.url
    if asyncpg:
        if backend.name != "postgresql":
            pytest.skip("asyncpg is a PostgreSQL driver")
        url = sa.make_url(url).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("job", 1)
    env = {
        **os.environ,
        "DELAYQ_URL": url,
        "DELAYQ_TEST_QUEUE": queue_name,
        "DELAYQ_TEST_MARKERS": str(tmp_path),
        "DELAYQ_TEST_DRIVER": "asyncio",
        "PYTHONPATH": str(Path(__file__).parent),
    }
    root = Path(__file__).parent.parent
    command = [sys.executable, "-m", "delayq.cli", "worker", "worker_app:handlers", "--driver", "asyncio"]
    worker = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: q.get("job") is None or worker.poll() is not None, "the asyncio worker to ack the message")
        assert worker.poll() is None, worker.communicate()[0].decode()
        assert [p.name for p in tmp_path.glob("*.done")] == [f"job.{worker.pid}.done"]
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=30)[0].decode()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    assert worker.returncode == 0, output
    assert "async worker stopped" in output


class _Coro:  # a module-level async handler for the migrate-hint test
    from delayq.aio import AsyncHandler as _Base

    class Handler(_Base):
        queue = "never"

        async def handle(self, delivery: Any, conn: object = None) -> None:
            pass


coro_handlers = [_Coro.Handler]

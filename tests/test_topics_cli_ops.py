"""`delayq topics create|publish|gc` and `groups`, with one-line errors for bad input, on every backend."""

from __future__ import annotations

import json
import uuid

from click.testing import CliRunner, Result
from conftest import Backend

from delayq import Subscription, Topic
from delayq.cli import main
from delayq.topics import partition_for


def cli(backend: Backend, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, ["--url", backend.url, "topics", *args], input=input)


def one_line_error(result: Result, text: str) -> None:
    assert result.exit_code == 2, result.output
    assert text in result.output and len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_create_publish_and_collect(backend: Backend) -> None:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    made = cli(backend, "create", name, "--partitions", "3")
    assert made.exit_code == 0 and made.output == f"{name}: created with 3 partitions\n"
    again = cli(backend, "create", name, "--partitions", "3")
    assert again.exit_code == 0 and again.output == f"{name}: exists with 3 partitions\n"
    one_line_error(cli(backend, "create", name, "--partitions", "4"), "exists with 3 partitions, not 4")

    out = cli(backend, "publish", name, "customer-1", '{"total": 12}', "--id", "order-1")
    assert (
        out.exit_code == 0 and out.output == f"{name}[{partition_for('customer-1', 3)}] customer-1 order-1: created\n"
    )
    dup = cli(backend, "publish", name, "customer-1", '{"total": 12}', "--id", "order-1")
    assert dup.output.endswith("order-1: ignored\n")
    piped = cli(backend, "publish", name, "customer-2", "-", input='"from stdin"')
    assert piped.exit_code == 0 and piped.output.endswith(": created\n")
    assert [t["published"] for t in json.loads(cli(backend, "ls", "--json").output) if t["topic"] == name] == [2]

    sub = Subscription(backend.engine, name, "billing", "b-1")
    sub.rebalance()
    got = sub.poll(10)
    assert sorted(json.dumps(d.payload) for d in got) == [json.dumps("from stdin"), json.dumps({"total": 12})]
    sub.ack_many(got)
    sub.advance_watermarks()
    sub.close()
    collected = cli(backend, "gc", name, "--batch", "1")
    assert collected.exit_code == 0 and collected.output == f"{name}: 2 message(s) collected\n"
    assert cli(backend, "gc", name).output == f"{name}: 0 message(s) collected\n"
    everything = cli(backend, "gc", "--keep-for", "1h")
    assert everything.exit_code == 0 and f"{name}: 0 message(s) collected" in everything.output

    longest = "x" * 90 + uuid.uuid4().hex[:6]  # 96 characters: its dead-letter topic's name has 100
    Topic(backend.engine, longest).create(1)
    dlq = cli(backend, "gc", f"{longest}_dlq")
    assert dlq.exit_code == 0 and dlq.output == f"{longest}_dlq: 0 message(s) collected\n"

    groups = json.loads(cli(backend, "groups", "ls", name, "--json").output)
    assert [(g["group"], g["lag"], g["subscribers"]) for g in groups] == [("billing", 0, 0)]


def test_bad_input_is_one_line_and_changes_nothing(backend: Backend) -> None:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    one_line_error(cli(backend, "create", name, "--partitions", "0"), "partition")
    one_line_error(cli(backend, "create", "bad name!", "--partitions", "2"), "topic")
    assert name not in cli(backend, "ls").output
    Topic(backend.engine, name).create(2)
    one_line_error(cli(backend, "publish", name, "k", "{not json"), "PAYLOAD is not JSON")
    one_line_error(cli(backend, "publish", "no-such-topic", "k", "1"), "no topic named 'no-such-topic'")
    one_line_error(cli(backend, "publish", name, "k", "@/no/such/file"), "cannot read the payload file")
    one_line_error(cli(backend, "gc", "no-such-topic"), "no topic named 'no-such-topic'")
    one_line_error(cli(backend, "gc", name, "--batch", "0"), "batch must be a positive int")
    one_line_error(cli(backend, "gc", name, "--keep-for", "soon"), "bad duration 'soon'")
    one_line_error(cli(backend, "gc", name, "--max-batches", "0"), "--max-batches must be at least 1")
    assert Topic(backend.engine, name).heads()[0].head == 0 and Topic(backend.engine, name).heads()[1].head == 0

"""The ``delayq`` data source: ``spark.read``, ``readStream``, ``write`` and ``writeStream`` on queues and topics.

Register it once per session with ``delayq.spark.register(spark)``; the options are in
``delayq.spark.options``, the columns and guarantees in docs/spark.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import warnings

import pyspark
from pyspark.sql import SparkSession
from pyspark.sql import types as T
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)

from delayq.errors import InvalidInputError
from delayq.spark.options import SourceOptions, UnreachableDatabaseError
from delayq.spark.read import DelayqReader, PushdownReader, check_tables, pushdown_supported, schema_for
from delayq.spark.stream import TopicStreamReader
from delayq.spark.write import DelayqStreamWriter, DelayqWriter, layout_for

FORMAT = "delayq"  # (delayq.spark.FORMAT)


class DelayqDataSource(DataSource):
    """Queues and topics as a Spark data source (format ``delayq``). Every option is checked on the driver,
    and the database is reached there once (the tables, the topic), before any task starts."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> T.StructType:
        return schema_for(SourceOptions.parse(self.options))

    def reader(self, schema: T.StructType) -> DataSourceReader:
        opts = SourceOptions.parse(self.options)
        _checked(opts)
        if pushdown_supported(pyspark.__version__):
            return PushdownReader(opts, schema)
        return DelayqReader(opts, schema)

    def streamReader(self, schema: T.StructType) -> DataSourceStreamReader:
        opts = SourceOptions.parse(self.options)
        if opts.topic is None:
            raise InvalidInputError("a streaming read needs the option 'topic' (a queue is read by workers)")
        _checked(opts)
        return TopicStreamReader(opts)

    def writer(self, schema: T.StructType, overwrite: bool) -> DataSourceWriter:
        return DelayqWriter(self._write_options(overwrite), schema)

    def streamWriter(self, schema: T.StructType, overwrite: bool) -> DataSourceStreamWriter:
        return DelayqStreamWriter(self._write_options(overwrite), schema)

    def _write_options(self, overwrite: bool) -> SourceOptions:
        opts = SourceOptions.parse(self.options)
        if overwrite:
            raise InvalidInputError("format delayq appends (offers, publishes): use mode('append')")
        if opts.dead:
            raise InvalidInputError("dead letters are read, not written: drop the option 'dead'")
        if opts.finished:
            raise InvalidInputError("finished messages are read, not written: drop the option 'finished'")
        _checked(opts)
        return opts


def _checked(opts: SourceOptions) -> None:
    """``check_tables``, its failure to connect raised afresh here: Spark shows the traceback, now two lines."""
    try:
        check_tables(opts)
    except UnreachableDatabaseError as exc:
        raise UnreachableDatabaseError(str(exc)) from None


def register(spark: SparkSession) -> None:
    """Make ``format("delayq")`` available in ``spark``; see ``delayq.spark.register``."""
    if pushdown_supported(pyspark.__version__):
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    else:
        warnings.warn(
            f"PySpark {pyspark.__version__} reuses a DataFrame's read plan across its queries: format delayq "
            "pushes no filter down with it (Spark filters the rows it reads)",
            stacklevel=3,
        )
    workers_python(spark)
    spark.dataSource.register(DelayqDataSource)


def workers_python(spark: SparkSession) -> None:
    """On a local master, make Spark's Python workers run this interpreter when the one they would run
    cannot import delayq: PySpark starts ``python3`` from PATH unless ``PYSPARK_PYTHON`` says otherwise, so
    a script run as ``venv/bin/python job.py`` without the venv on PATH failed in every task with
    ``No module named 'delayq'``. A Python chosen by the user is kept; on a cluster, set ``PYSPARK_PYTHON``."""
    sc = spark.sparkContext
    if os.environ.get("PYSPARK_PYTHON") or sc.getConf().get("spark.pyspark.python") or sc.pythonExec != "python3":
        return
    found = shutil.which("python3")
    if found is not None:
        check = [found, "-c", "import delayq, pyarrow"]
        if subprocess.run(check, capture_output=True, timeout=60, check=False).returncode == 0:
            return
    if not str(sc.master).startswith("local"):
        return
    logging.getLogger("delayq.spark").info(
        "delayq: Spark's Python workers run %s (%s cannot import delayq)", sys.executable, found or "python3"
    )
    sc.pythonExec = sys.executable


__all__ = ["FORMAT", "DelayqDataSource", "layout_for", "register"]

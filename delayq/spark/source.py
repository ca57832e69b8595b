"""The ``delayq`` data source: ``spark.read``, ``readStream``, ``write`` and ``writeStream`` on queues and topics.

Register it once per session with ``delayq.spark.register(spark)``; the options are in
``delayq.spark.options``, the columns and guarantees in docs/spark.md.
"""

from __future__ import annotations

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
from delayq.spark.options import SourceOptions
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
        check_tables(opts)
        if pushdown_supported(pyspark.__version__):
            return PushdownReader(opts, schema)
        return DelayqReader(opts, schema)

    def streamReader(self, schema: T.StructType) -> DataSourceStreamReader:
        opts = SourceOptions.parse(self.options)
        if opts.topic is None:
            raise InvalidInputError("a streaming read needs the option 'topic' (a queue is read by workers)")
        check_tables(opts)
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
        check_tables(opts)
        return opts


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
    spark.dataSource.register(DelayqDataSource)


__all__ = ["FORMAT", "DelayqDataSource", "layout_for", "register"]

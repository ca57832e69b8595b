"""PySpark: delayq as a Spark data source, and functions over DataFrames.

Install with ``pip install 'delayq[spark]'``. Importing ``delayq`` never imports pyspark; this package does.

``register(spark)`` makes ``format("delayq")`` available: batch reads of a queue's messages or dead letters
and of a topic's log; batch and streaming writes as offers or publishes
(idempotent by key or id); a streaming read of a topic with its per-partition offsets as the stream's
offsets. See docs/spark.md. ``offer_dataframe`` (which returns the counts) and ``read_messages`` are the
same operations as plain functions.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from delayq.spark.dataframes import OfferCounts, offer_dataframe, read_messages
from delayq.spark.options import check_url

FORMAT = "delayq"


def register(spark: SparkSession) -> None:
    """Make ``spark.read/readStream/write/writeStream.format("delayq")`` available in this session.

    Needs PySpark 4.2 or 4.3 (its Python Data Source API with read limits), and pyarrow. On a local master
    whose workers would start a ``python3`` that cannot import delayq (no ``PYSPARK_PYTHON``), the workers
    run this interpreter instead. On PySpark 4.2 and 4.3, which reuse a DataFrame's read plan across its
    queries, the reader pushes no filter down, and a ``UserWarning`` names the version (docs/spark.md).
    """
    from delayq.spark.source import register as _register  # PySpark < 4.2 can still use the functions

    _register(spark)


__all__ = ["FORMAT", "OfferCounts", "check_url", "offer_dataframe", "read_messages", "register"]

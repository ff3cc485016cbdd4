"""The shapes of the pipeline's tables: events in, reports out.

SUMMARY
    RAW_EVENT_SCHEMA   the accounting log's JSON lines as read (time is text)
    EVENT_SCHEMA       events after normalisation (time is a timestamp)
    CLASSIFIED_SCHEMA  EVENT_SCHEMA plus category, hard and reason
    STORED_SCHEMA      what an ingested table keeps beside EVENT_SCHEMA
    SUPPRESSION_SCHEMA what the suppress job produces

DESCRIPTION
    Every transformation in sluice.pipeline states the schema it takes and
    the schema it returns, so that a change of the accounting contract
    (sluice.accounting.EVENT_FIELDS) breaks a test rather than a report.
    The column order of EVENT_SCHEMA is the order of EVENT_FIELDS.

SEE ALSO
    sluice.accounting, docs/accounting.md, docs/analytics.md
"""

from __future__ import annotations

from pyspark.sql.types import (
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from sluice.accounting import EVENT_FIELDS

__all__ = [
    "CLASSIFIED_SCHEMA",
    "CORRUPT_COLUMN",
    "EVENT_SCHEMA",
    "RAW_EVENT_SCHEMA",
    "STORED_MASK",
    "STORED_RULES",
    "STORED_SCHEMA",
    "SUPPRESSION_SCHEMA",
]

#: Where Spark's JSON reader puts a line it could not parse.
CORRUPT_COLUMN = "_corrupt_record"

_TYPES: dict[str, DataType] = {
    "attempt": IntegerType(),
    "code": IntegerType(),
    "queue_age_s": DoubleType(),
    "size": LongType(),
    "duration_s": DoubleType(),
    "is_report": BooleanType(),
    "refused": MapType(StringType(), LongType()),  # session lines: reply code -> count
    "auth_failures": IntegerType(),
}


def _event_schema(time_type: StringType | TimestampType) -> StructType:
    fields = []
    for name in EVENT_FIELDS:
        if name == "time":
            fields.append(StructField(name, time_type, True))
        else:
            fields.append(StructField(name, _TYPES.get(name, StringType()), True))
    return StructType(fields)


EVENT_SCHEMA: StructType = _event_schema(TimestampType())

RAW_EVENT_SCHEMA: StructType = StructType(
    [*_event_schema(StringType()).fields, StructField(CORRUPT_COLUMN, StringType(), True)]
)

#: Derived columns an ingested table stores beside EVENT_SCHEMA
#: (sluice.pipeline.ingest): a failure's masked reply (null for other
#: events), and the id of the masking rules that made it
#: (rules.MASK_RULES_ID), so that a report masks again only what older
#: rules masked.  Masking is the costliest step after parsing; stored, it
#: is paid once per event instead of once per report.
STORED_MASK = "masked_reply"
STORED_RULES = "mask_rules"
STORED_SCHEMA: StructType = StructType(
    [StructField(STORED_MASK, StringType(), True), StructField(STORED_RULES, LongType(), True)]
)

CLASSIFIED_SCHEMA: StructType = StructType(
    [
        *EVENT_SCHEMA.fields,
        StructField("category", StringType(), True),
        StructField("hard", BooleanType(), True),
        StructField("reason", StringType(), True),
    ]
)

SUPPRESSION_SCHEMA: StructType = StructType(
    [
        StructField("address", StringType(), False),
        StructField("reason", StringType(), False),  # hard | soft
        StructField("category", StringType(), True),
        StructField("code", IntegerType(), True),
        StructField("enhanced", StringType(), True),
        StructField("response", StringType(), True),
        StructField("first_at", TimestampType(), True),
        StructField("last_at", TimestampType(), True),
        StructField("count", LongType(), False),
        StructField("expires_at", TimestampType(), True),
    ]
)

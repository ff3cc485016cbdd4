"""Expressions: the rules of sluice.pipeline.rules as Spark columns.

SUMMARY
    with_masked(df, source, target) -> DataFrame   rules.mask() as regexp_replace steps
    reason(code, enhanced, masked) -> Column  "550 5.1.1 <addr>... user unknown"
    category(event, enhanced, masked) -> Column
    hard(event, category) -> Column
    throttle(code, enhanced, text) -> Column   rules.throttle_kind()
    mx_group(host) -> Column            rules.mx_group()'s id

DESCRIPTION
    Built-in functions only (regexp_replace, rlike, CASE WHEN): no Python
    UDF, so no rows travel between the JVM and Python workers, and the same
    plan runs on any cluster.  Each builder follows its reference function
    in rules.py rule by rule; tests check that they agree.

SEE ALSO
    sluice.pipeline.rules
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sluice.pipeline import rules

__all__ = ["category", "hard", "mx_group", "reason", "throttle", "with_masked"]


def with_masked(df: DataFrame, source: str, target: str) -> DataFrame:
    """Add column ``target`` = rules.mask(``source``) to ``df``.

    One column step per rule, each guarded by its cheap substring test (a
    rule without one by a test for the empty text, which no rule changes);
    a nested Column expression would repeat the previous steps in every
    guard and grow with 2**rules.
    """
    out = df.withColumn(target, F.coalesce(F.col(source), F.lit("")))
    for pattern, replacement, guard in rules.MASK_RULES:
        step = F.regexp_replace(F.col(target), pattern, replacement)
        if guard:
            present = F.col(target).contains(guard[0])
            for extra in guard[1:]:
                present = present | F.col(target).contains(extra)
        else:
            present = F.col(target) != ""
        out = out.withColumn(target, F.when(present, step).otherwise(F.col(target)))
    return out.withColumn(target, F.substring(F.trim(F.col(target)), 1, rules.MASK_MAX))


def reason(code: Column, enhanced: Column, masked_text: Column) -> Column:
    """Code, enhanced code and masked text: the key equal failures share."""
    return F.concat_ws(
        " ",
        code.cast("string"),
        F.when(enhanced != "", enhanced),
        F.when(masked_text != "", masked_text),
    )


def _full(col: Column, pattern: str) -> Column:
    return F.coalesce(col, F.lit("")).rlike(f"^(?:{pattern})$")


def category(event: Column, enhanced: Column, text: Column) -> Column:
    """The first matching BOUNCE_RULES entry's category, else "other"."""
    reply_text = F.coalesce(text, F.lit(""))
    chain: Column | None = None
    for rule in rules.BOUNCE_RULES:
        parts: list[Column] = []
        if rule.event is not None:
            parts.append(event == rule.event)
        if rule.enhanced is not None:
            parts.append(_full(enhanced, rule.enhanced))
        if rule.text is not None:
            parts.append(reply_text.rlike(rule.text))
        cond = parts[0]
        for part in parts[1:]:
            cond = cond & part
        value = F.lit(str(rule.category))
        chain = F.when(cond, value) if chain is None else chain.when(cond, value)
    assert chain is not None, "BOUNCE_RULES is empty"
    return chain.otherwise(F.lit(str(rules.BounceCategory.OTHER)))


def hard(event: Column, category_col: Column) -> Column:
    """Whether an event is a bounce of a hard category (never null)."""
    hard_names = sorted(str(c) for c in rules.HARD_CATEGORIES)
    return F.coalesce((event == "bounced") & category_col.isin(hard_names), F.lit(False))


def throttle(code: Column, enhanced: Column, text: Column) -> Column:
    """ThrottleKind value, or null when the reply is not a throttle."""
    reply_text = F.coalesce(text, F.lit(""))
    is_throttle = (
        code.isin(list(rules.THROTTLE_CODES))
        & ~reply_text.rlike(rules.GREYLIST_TEXT)
        & ~F.coalesce(_full(enhanced, rules.MAILBOX_STATUS), F.lit(False))
        & (_full(enhanced, r"4\.7\.\d{1,3}") | reply_text.rlike(rules.THROTTLE_TEXT))
    )
    kinds = rules.ThrottleKind
    kind = (
        F.when(reply_text.rlike(rules.CONNECT_RATE_TEXT), F.lit(str(kinds.CONNECT_RATE)))
        .when(reply_text.rlike(rules.CONNECTIONS_TEXT), F.lit(str(kinds.CONNECTIONS)))
        .otherwise(F.lit(str(kinds.RATE)))
    )
    return F.when(F.coalesce(is_throttle, F.lit(False)), kind)


def mx_group(host: Column) -> Column:
    """The destination group id of an MX host name (null stays null)."""
    name = F.regexp_replace(F.lower(host), r"\.$", "")
    chain: Column | None = None
    for gid, patterns in rules.PROVIDER_GROUPS:
        cond = name.rlike("|".join(f"(?:{rules.glob_to_regex(p)[4:]})" for p in patterns))
        chain = F.when(cond, F.lit(gid)) if chain is None else chain.when(cond, F.lit(gid))
    assert chain is not None
    second = "|".join(rules.SECOND_LEVEL)
    registered = F.when(
        name.rlike(rf"\.(?:{second})\.[a-z]{{2}}$"),
        F.regexp_extract(name, r"([^.]+\.[^.]+\.[^.]+)$", 1),
    ).otherwise(F.regexp_extract(name, r"([^.]+\.[^.]+|[^.]+)$", 1))
    derived = F.regexp_replace(F.regexp_replace(registered, r"[^a-z0-9]+", "-"), r"^-+|-+$", "")
    ip = F.regexp_replace(F.regexp_replace(name, r"^\[|\]$", ""), r"^ipv6:", "")
    literal = F.concat(F.lit("ip-"), F.regexp_replace(
        F.regexp_replace(ip, r"[^a-z0-9]+", "-"), r"^-+|-+$", ""))
    return F.when(host.isNull() | (name == ""), F.lit(None).cast("string")).when(
        name.rlike(rules.IP_LITERAL), literal).otherwise(
        chain.otherwise(F.when(derived == "", F.lit("unknown")).otherwise(derived))
    )

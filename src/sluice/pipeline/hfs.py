"""Files on any path Spark can reach: local, HDFS, S3 -- through the Hadoop FileSystem API.

SUMMARY
    write_text(spark, path, text)    replace a small file atomically where the store allows
    replace_with_part(spark, parts_dir, path)   a one-task Spark output becomes ``path``
    read_text(spark, path) -> str | None
    exists(spark, path) -> bool
    is_local(path) -> bool

DESCRIPTION
    Tables go through Spark's writers; the few files the driver makes
    itself (report.html, policy.yaml, the suppression list, a sendout's
    summary) go through here, so that ``--output hdfs:///analytics/day``
    or ``s3a://bucket/day`` work like a local directory.  A plain path
    (no scheme) is written by Python: temporary file, fsync, rename,
    directory fsync.  Any URI, ``file://`` too, is written with the
    Hadoop FileSystem of the running session -- the same classes and
    settings (``spark.hadoop.*``) Spark's own writers use -- to a
    temporary name, then renamed over the target with
    FileContext.rename(OVERWRITE), atomic on HDFS; object stores copy.

STRATEGIES
    PySpark has no public Python API for Hadoop's FileSystem; it is
    reached through the session's Py4J gateway (SparkContext._jvm and
    ._jsc), only read, never patched, and only in this module.

SEE ALSO
    sluice.pipeline.load, sluice.pipeline.jobs
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

__all__ = ["exists", "is_local", "local_path", "read_text", "replace_with_part", "write_text"]


def is_local(path: str) -> bool:
    """Whether Python writes ``path``: a plain path, with no scheme.

    Every URI -- ``file://`` included -- goes through Hadoop, as Spark's own
    writers do.
    """
    _, sep, _ = path.partition("://")
    return not sep


def local_path(path: str) -> Path:
    """The Path of a plain (local) path."""
    return Path(path)


def _hadoop(spark: SparkSession, path: str) -> tuple[Any, Any, Any]:
    """(jvm, FileSystem, Path) for ``path`` in this session's Hadoop configuration."""
    sc = spark.sparkContext
    jvm: Any = sc._jvm
    jsc: Any = sc._jsc
    conf = jsc.hadoopConfiguration()
    jpath = jvm.org.apache.hadoop.fs.Path(path)
    return jvm, jpath.getFileSystem(conf), jpath


def _write_local(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_text(spark: SparkSession | None, path: str, text: str) -> str:
    """Replace ``path`` with ``text`` (UTF-8); returns the path."""
    data = text.encode("utf-8")
    if is_local(path):
        _write_local(local_path(path), data)
        return str(local_path(path))
    if spark is None:
        raise ValueError(f"{path}: writing to a URI needs a Spark session")
    jvm, fs, target = _hadoop(spark, path)
    parent = target.getParent()
    fs.mkdirs(parent)
    tmp = jvm.org.apache.hadoop.fs.Path(parent, f".{target.getName()}.{uuid.uuid4().hex}.tmp")
    out = fs.create(tmp, True)
    try:
        out.write(bytearray(data))
        out.hsync()
    finally:
        out.close()
    _move_over(spark, jvm, fs, tmp, target, path)
    return path


def _move_over(spark: SparkSession, jvm: Any, fs: Any, source: Any, target: Any,
               path: str) -> None:
    try:
        jsc: Any = spark.sparkContext._jsc
        conf = jsc.hadoopConfiguration()
        fc = jvm.org.apache.hadoop.fs.FileContext.getFileContext(target.toUri(), conf)
        rename = jvm.org.apache.hadoop.fs.Options.Rename
        gateway: Any = spark.sparkContext._gateway
        options = gateway.new_array(rename, 1)
        options[0] = rename.OVERWRITE
        fc.rename(source, target, options)
    except Exception:
        # A store without an AbstractFileSystem binding: not atomic, but whole.
        fs.delete(target, False)
        if not fs.rename(source, target):
            fs.delete(source, False)
            raise OSError(f"{path}: cannot rename the new file into place") from None


def replace_with_part(spark: SparkSession, parts_dir: str, path: str) -> None:
    """Move the one part file of the Spark output ``parts_dir`` over ``path``.

    It is fsynced first where local; ``parts_dir`` is then removed.
    """
    if is_local(parts_dir) and is_local(path):
        parts = sorted(local_path(parts_dir).glob("part-*"))
        if len(parts) != 1:
            raise OSError(f"{parts_dir}: expected one part file, found {len(parts)}")
        with parts[0].open("rb") as fh:
            os.fsync(fh.fileno())
        target = local_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(parts[0], 0o644)
        os.replace(parts[0], target)
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        shutil.rmtree(local_path(parts_dir), ignore_errors=True)
        return
    jvm, fs, directory = _hadoop(spark, parts_dir)
    found = fs.globStatus(jvm.org.apache.hadoop.fs.Path(directory, "part-*"))
    if found is None or len(found) != 1:
        raise OSError(f"{parts_dir}: expected one part file")
    _, _, target = _hadoop(spark, path)
    fs.mkdirs(target.getParent())
    _move_over(spark, jvm, fs, found[0].getPath(), target, path)
    fs.delete(directory, True)


def read_text(spark: SparkSession | None, path: str) -> str | None:
    """The file's text, or None when it does not exist."""
    if is_local(path):
        try:
            return local_path(path).read_text("utf-8")
        except FileNotFoundError:
            return None
    if spark is None:
        raise ValueError(f"{path}: reading a URI needs a Spark session")
    jvm, fs, target = _hadoop(spark, path)
    if not fs.exists(target):
        return None
    stream = fs.open(target)
    try:
        data = jvm.org.apache.commons.io.IOUtils.toByteArray(stream)
    finally:
        stream.close()
    return bytes(data).decode("utf-8")


def exists(spark: SparkSession | None, path: str) -> bool:
    """Whether ``path`` exists; a URI is asked through the session's Hadoop FileSystem."""
    if is_local(path):
        return local_path(path).exists()
    if spark is None:
        raise ValueError(f"{path}: a URI needs a Spark session")
    _, fs, target = _hadoop(spark, path)
    return bool(fs.exists(target))

"""A YAML loader that refuses a key written twice in one mapping.

SUMMARY
    yaml.load(text, Loader=UniqueKeyLoader)  # DuplicateKeyError names both lines

STRATEGY
    YAML itself keeps the last of two equal keys silently, which hides a
    setting the operator thought was in force.  UniqueKeyLoader is
    PyYAML's SafeLoader that walks the composed node tree once before
    constructing it, at any depth, and raises DuplicateKeyError with the
    key path and both line numbers.  Aliases are checked where their
    anchor is; "<<" merges, YAML's own way of overriding, are allowed.

SEE ALSO
    sluice.config.loader (turns the error into a ConfigError)
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "UniqueKeyLoader"]


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping; ``keypath`` names it, str() the lines."""

    def __init__(self, keypath: str, message: str) -> None:
        super().__init__(message)
        self.keypath = keypath


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping, at any depth."""

    def construct_document(self, node: yaml.Node) -> Any:
        """Refuse duplicate keys in the whole document, then construct it."""
        _refuse_duplicates(self, node, "", set())
        return super().construct_document(node)


def _refuse_duplicates(loader: yaml.SafeLoader, node: yaml.Node, path: str,
                       seen_nodes: set[int]) -> None:
    if id(node) in seen_nodes:  # an alias: checked where its anchor is
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(loader, item, f"{path}[{i}]", seen_nodes)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[object, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # "<<" merges are YAML's own way of overriding on purpose
        key = loader.construct_object(key_node, deep=True)
        keypath = f"{path}.{key}" if path else str(key)
        line = key_node.start_mark.line + 1
        try:
            seen = first_line.get(key)
            first_line.setdefault(key, line)
        except TypeError:
            continue  # an unhashable key: the constructor says so itself
        if seen is not None:
            raise DuplicateKeyError(keypath, f"duplicate key at line {line} "
                                    f"(first at line {seen}; YAML would keep the last)")
        _refuse_duplicates(loader, value_node, keypath, seen_nodes)

"""Reading YAML strictly: a duplicate key, a tab in the indentation or a syntax error names the file and line."""

from __future__ import annotations

from pathlib import Path

import yaml

from fsdp_peft.core.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{self.name}:{line}: duplicate key '{key}' (first set on line {seen[key]}); keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: Path):
    """A YAML file's value; syntax errors, duplicate keys and tab indentation name the file and line."""
    text = path.read_text()
    for number, line in enumerate(text.splitlines(), start=1):
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        if "\t" in indent:
            raise ConfigError(f"{path}:{number}: a tab in the indentation; YAML indents with spaces only")
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()

from __future__ import annotations


class ConfigError(Exception):
    """Bad configuration, in one line that names the file, the key and what was wrong."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source = source
        self.key = key
        self.problem = problem
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}")

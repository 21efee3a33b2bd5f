from __future__ import annotations


class ConfigError(Exception):
    """Bad configuration, in one line that names the file, the key and what was wrong."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source = source
        self.key = key
        self.problem = problem
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}")


def one_line(exc: BaseException) -> str:
    """An unexpected error as one log line: its type and message, newlines folded."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

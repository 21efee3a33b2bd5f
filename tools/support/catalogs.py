"""Catalogs the commands and tests write: the tiny model served by llama-server (what
``tools/fleet`` and the lab start with), and catalogs of a given size (reload benchmarks
and tests)."""

from __future__ import annotations

from pathlib import Path

from tools.support.tinymodel import write_model


def write_tiny_catalog(d: Path) -> Path:
    """``d/catalog.toml`` serving the tiny model (``d/tiny.gguf``, made once) with
    llama-server, one replica; returns the catalog's path."""
    model = d / "tiny.gguf"
    if not model.exists():
        write_model(model, ends_after=4)
    catalog = d / "catalog.toml"
    catalog.write_text(
        f"""# the tiny model tools/support/tinymodel.py generates, served by llama.cpp's llama-server
[models.tiny]
replicas = 1
[[models.tiny.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "{model}"
settings = {{ context = 512, parallel = 1, threads = 1, threads_batch = 1 }}
startup_timeout_s = 120
"""
    )
    return catalog


def catalog_of(size: int) -> str:
    """Catalog entries of models that want no replica (one per ~105 bytes), at least
    ``size`` bytes of them."""
    parts: list[str] = []
    total = 0
    i = 0
    while total < size:
        entry = (
            f"[models.m{i:06d}]\nreplicas = 0\n[[models.m{i:06d}.profiles]]\n"
            f'name = "cpu"\nengine = "llama.cpp"\nmin_memory_gb = 4\n'
            f'model_path = "/var/lib/llmgw-weights/model-{i:06d}.gguf"\n'
            "settings = { context = 4096, parallel = 2 }\n"
        )
        parts.append(entry)
        total += len(entry)
        i += 1
    return "".join(parts)

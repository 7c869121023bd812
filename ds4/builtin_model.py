"""The built-in tiny model as the engine opens it: random V4 weights, the real tokenizer.

The model layer writes the weights and knows nothing of tokenizers; the tokenizer file is
chosen here, at the engine level, and handed down. `ds4.engine` re-exports both functions, so
the server and the CLI never reach into `ds4.model`.
"""

from __future__ import annotations

from pathlib import Path

from ds4.model import tiny
from ds4.tokenizer import packaged_tokenizer_path


def make_tiny(directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny model with the packaged V4 tokenizer.json into `directory`."""
    return tiny.make_tiny(directory, seed=seed, tokenizer_json=packaged_tokenizer_path())


def default_model_dir() -> Path:
    """The cached built-in tiny model, made once, tokenizer.json included."""
    return tiny.default_model_dir(packaged_tokenizer_path())

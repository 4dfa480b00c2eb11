"""Publishing a Hugging Face weight save: the directory ends holding exactly the new weights.

Earlier weight files are removed, the new ones renamed into place and the index written last:
no loader ever sees old and new weights together. Files that are not weights are left alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zero_full.checkpoint.io import fsync_dir

__all__ = ["WEIGHT_FILE", "publish_weights"]

WEIGHT_FILE = re.compile(
    r"^(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index\.json)$"
)
"""Names of the weight files and indexes ``transformers`` reads from a model directory."""


def publish_weights(directory: Path, written: dict[str, Path], index: tuple[str, str] | None) -> None:
    """Replace ``directory``'s weights by ``written`` (final name -> complete temporary file).

    Args:
        directory: The model directory.
        written: Each new weight file's final name and the temporary file holding it.
        index: ``(name, text)`` of the new index (sharded saves), ``None`` for a single file.
    """
    keep = {name for name in written if index is None}  # a single file replaces its old self atomically
    for entry in sorted(directory.iterdir()):
        if WEIGHT_FILE.match(entry.name) and entry.name not in keep and entry.is_file():
            entry.unlink()
    for name, tmp in written.items():
        os.replace(tmp, directory / name)
    if index is not None:
        name, text = index
        tmp = directory / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, directory / name)
    fsync_dir(directory)

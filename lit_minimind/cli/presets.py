"""The packaged configs (``lit_minimind/conf/*.yaml``): the embedded default and the presets, by name.

They ship inside the package, so an installed ``lit_minimind`` finds them wherever it runs:
``--config minimind_pretrain`` is ``--config <package>/conf/minimind_pretrain.yaml``. A path (anything
with a slash or a suffix, or an existing file) passes through unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

from lit_minimind.errors import UsageError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
DEFAULT_CONFIG = CONF_DIR / "default.yaml"
_NAME = re.compile(r"[\w-]+")  # no slash, no dot: a file name would have a suffix


def preset_names() -> list[str]:
    """The names ``--config`` accepts: the packaged ``*.yaml`` files' stems, sorted."""
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def preset_path(value: str) -> str:
    """``value`` of ``--config``: a preset name becomes its packaged file; anything else is returned as is."""
    if not _NAME.fullmatch(value) or Path(value).exists():
        return value
    path = CONF_DIR / f"{value}.yaml"
    if not path.is_file():
        raise UsageError(f"--config {value}: no such file, nor a preset of that name "
                         f"(presets: {', '.join(preset_names())})")
    return str(path)


def resolve_presets(args: list[str]) -> list[str]:
    """``args`` with every ``--config NAME`` / ``--config=NAME`` / ``-c NAME`` naming a packaged preset."""
    out, i = [], 0
    while i < len(args):
        tok = args[i]
        if tok in ("--config", "-c") and i + 1 < len(args):
            out += [tok, preset_path(args[i + 1])]
            i += 2
            continue
        out.append("--config=" + preset_path(tok[len("--config="):]) if tok.startswith("--config=") else tok)
        i += 1
    return out

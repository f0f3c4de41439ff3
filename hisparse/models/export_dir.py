"""Where ``hisparse export-model`` puts its files: a fresh directory built beside the target and
swapped in whole.

Writing into the target file by file would leave whatever else it held: a loader that follows an
old ``model.safetensors.index.json`` would load the old shards beside the new weights. So the
export is written into a temporary directory in the target's parent and then takes the target's
place in one rename. A non-empty target is replaced only when it is an earlier export (its
``config.json`` names the exported architecture and it holds nothing the export does not write),
or when the caller forces it. The new directory's mode follows the process umask, as ``mkdir``
would make it, not ``mkdtemp``'s 0700 (a server running as another user must read it).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

#: Every file an export writes (a directory holding only these is one the exporter may replace).
EXPORT_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
)
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


class ExportError(ValueError):
    """An export's argument is out of range, or its directory cannot take it (the message names
    which)."""


def write_export(
    out_dir, write: Callable[[Path], None], is_export_config: Callable[[dict], bool], force: bool
) -> Path:
    """``write(tmp)`` fills a fresh directory beside ``out_dir``, which then replaces ``out_dir``
    whole: an export that fails (a full disk, an interrupt) changes nothing, and one that
    succeeds leaves no file of what was there before. A non-empty ``out_dir`` that is not an
    earlier export (``is_export_config`` of its config.json) is refused unless ``force``."""
    out = Path(os.path.abspath(out_dir))
    if out.is_symlink():  # replace what the link points to, not the link
        out = Path(os.path.realpath(out))
    if out.exists() and not out.is_dir():
        raise ExportError(f"DIR {str(out)!r} exists and is not a directory")
    anchor = next(p for p in (out, *out.parents) if p.exists())  # nearest existing folder
    if anchor == out:
        anchor = out.parent
    if not os.access(anchor, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ExportError(f"DIR {str(out)!r} is not writable")
    foreign = foreign_entry(out, is_export_config)
    if foreign is not None and not force:
        raise ExportError(
            f"DIR {str(out)!r} is not empty and is not an earlier export ({foreign}); "
            "pass --force to replace it whole"
        )
    tmp = fresh_dir(anchor, out.name)
    try:
        write(tmp)
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def foreign_entry(out: Path, is_export_config: Callable[[dict], bool]) -> Optional[str]:
    """None when ``out`` may be replaced without asking (missing, empty, or an earlier export);
    else why it is someone else's directory."""
    if not out.exists():
        return None
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return None
    extra = [n for n in names if n not in EXPORT_FILES]
    if extra:
        return f"it holds {extra[0]!r}, which an export does not write"
    try:
        config = json.loads((out / "config.json").read_text())
    except FileNotFoundError:
        return "it has no config.json"
    except (OSError, ValueError):
        return "its config.json does not read as JSON"
    if isinstance(config, dict) and is_export_config(config):
        return None
    return "its config.json is not an export's"


def process_umask() -> int:
    """The umask, read without changing it where Linux reports it (os.umask can only set it,
    and setting it briefly would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fresh_dir(anchor: Path, name: str) -> Path:
    """An empty directory in ``anchor`` (hidden, unique), with the mode ``mkdir`` would give."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.export-", dir=anchor))
    os.chmod(tmp, 0o777 & ~process_umask())
    return tmp


def swap_in(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an existing ``out`` is removed. Where the kernel can exchange two
    directories in one step, ``out`` is never missing; elsewhere it is, between two renames."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        os.rename(tmp, out)
        return
    if _exchange(tmp, out):
        # tmp now holds the old directory; the export is in place whether or not it goes.
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old)  # onto an empty directory: allowed, replaces it
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """renameat2(RENAME_EXCHANGE) where libc and the filesystem have it; False otherwise."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0

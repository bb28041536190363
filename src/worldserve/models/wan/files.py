"""What every Wan model's finder of published files shares: the folder walk, one candidate per part.

Owns: :func:`walk_published` (the published files and folders under a folder, a few levels down,
in name order), :func:`single_candidate` (a part's one candidate, several being an error),
:func:`expected_from` (what an error says was expected: a part's published names) and
:func:`find_taehv` (TAEHV's ``taew2_1.pth``, :data:`TAEHV_FILE`, or Wan2.2's ``taew2_2.pth``,
:data:`TAEHV22_FILE`, under a folder: the optional ``decoder=taehv`` of the Wan models). Each
model's own published names live with it (``wancausal.files``, ``matrixgame.files``). Names
only: reading the files is the loaders' job.
Must not know: torch, the models, sessions.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["TAEHV22_FILE", "TAEHV_FILE", "expected_from", "find_taehv", "single_candidate", "walk_published"]

K = TypeVar("K")

#: TAEHV's published decoder for Wan2.1's latents (madebyollin/taehv): used only with ``decoder=taehv``.
TAEHV_FILE = "taew2_1.pth"
#: TAEHV's published decoder for Wan2.2's latents (48 channels, 16x spatial), as ABot-World's folder ships it.
TAEHV22_FILE = "taew2_2.pth"
_DEPTH = 4


def expected_from(published: dict[str, tuple[str, str | None]], part: str, what: str) -> str:
    """``what`` and the names ``part`` is published under, as an error says what was expected."""
    names = [name if not name.endswith("/") else f"a folder {name}" for name, (p, _) in published.items() if p == part]
    return f"{what}: {', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else f"{what}: {names[0]}"


def walk_published(folder: Path, kind: Callable[[Path], K | None]) -> list[tuple[Path, K]]:
    """Every file and folder under ``folder`` (``weights=``), a few levels down, that ``kind`` names.

    Walked in name order (folders before files at each level), so what is found is the same on
    every machine. A ``folder`` that is not one is an error.
    """
    if not folder.is_dir():
        raise ValueError(f"weights={folder}: not a folder.")
    found: list[tuple[Path, K]] = []
    base = len(folder.parts)
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        dirs.sort()
        if len(here.parts) - base >= _DEPTH:
            dirs[:] = []
        for name in (*dirs, *sorted(files)):
            path = here / name
            named = kind(path)
            if named is not None:
                found.append((path, named))
    return found


def single_candidate(folder: Path, candidates: dict[str, list[Path]], part: str) -> Path | None:
    """``part``'s one candidate under ``folder`` (None: none); several are an error that lists them."""
    found = candidates.get(part, [])
    if len(found) > 1:
        listed = ", ".join(str(p.relative_to(folder)) for p in found)
        raise ValueError(f"weights={folder}: several {part.replace('_', ' ')} candidates ({listed}); pass {part}=PATH.")
    return found[0] if found else None


def find_taehv(folder: str | Path, name: str = TAEHV_FILE) -> Path | None:
    """The one ``name`` (``taew2_1.pth`` or ``taew2_2.pth``) under ``folder`` (None: none; several are an
    error that lists them)."""
    folder = Path(folder)
    found = walk_published(folder, lambda path: "taehv" if path.name == name and path.is_file() else None)
    return single_candidate(folder, {"taehv": [path for path, _ in found]}, "taehv")

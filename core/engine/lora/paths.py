"""Which folders an adapter may be loaded from: a path is allowed when, with every symlink resolved, it lies inside
one of the operator's folders (``lora.lora_dir``, ``lora.allowed_lora_paths``, ``lora.lora_modules``)."""

from __future__ import annotations

import os
from typing import Iterable


def path_within(path: str, roots: Iterable[str]) -> bool:
    """Whether ``path`` (symlinks resolved) is one of ``roots`` or lies below one; a path that spells ``..`` is
    never within (a client may not walk out of a folder, even back into it)."""
    if ".." in path.replace("\\", "/").split("/"):
        return False
    real = os.path.realpath(path)
    for root in roots:
        if not root:
            continue
        base = os.path.realpath(root)
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return True
    return False

"""The built-in LoRA resolver: ``filesystem`` serves ``lora.lora_dir/<name>`` when a request names an adapter the
server has not loaded."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import ClassVar, Optional

from engine.hookspecs import hookimpl
from engine.interfaces.base import SelectionContext
from engine.interfaces.lora_resolver import LoRAResolver
from engine.lora.adapter import CONFIG_FILE
from engine.lora.paths import path_within
from engine.lora_request import LoRARequest


class FilesystemResolver(LoRAResolver):
    """``lora_dir/<name>``: a folder holding ``adapter_config.json`` directly under ``lora.lora_dir`` (a name with a
    path separator, ``..`` or a symlink out of the folder finds nothing)."""

    name: ClassVar[str] = "filesystem"
    priority: ClassVar[int] = 0

    @classmethod
    def unavailable_reasons(cls, ctx: SelectionContext) -> list[str]:
        if not ctx.config.lora.enable_lora:
            return ["LoRA is off (lora.enable_lora)"]
        if not ctx.config.lora.lora_dir:
            return ["no lora.lora_dir to look in"]
        return []

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> Optional[LoRARequest]:
        root = self.vllm_config.lora.lora_dir
        if not root or not lora_name or lora_name in (".", "..") or "/" in lora_name or os.sep in lora_name:
            return None
        folder = Path(root) / lora_name

        def found() -> bool:
            return path_within(str(folder), [root]) and (folder / CONFIG_FILE).is_file()

        if not await asyncio.to_thread(found):
            return None
        return LoRARequest(lora_name, 1, str(folder), base_model_name)


@hookimpl
def engine_lora_resolvers():
    return [FilesystemResolver]

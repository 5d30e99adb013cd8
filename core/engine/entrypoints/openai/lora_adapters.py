"""ServedAdapters: the LoRA adapters an API server serves by name, loaded at start (``lora.lora_modules``), at
runtime (``/v1/load_lora_adapter``) or found by a resolver plugin when a request names one."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from typing import Any, Optional

from engine.config import VllmConfig
from engine.entrypoints.openai.errors import APIError
from engine.lora.adapter import LoRAAdapterError
from engine.lora.paths import path_within
from engine.lora_request import LoRARequest

logger = logging.getLogger("engine.server")

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def adapter_id(name: str, path: str) -> int:
    """A positive id from the adapter's name and folder: every API server process gives one adapter the same id
    (the workers tell adapters apart by it), and a name loaded again from another folder gets another."""
    digest = hashlib.sha256(f"{name}\0{os.path.realpath(path)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


class ServedAdapters:
    """Adapters by name, for the requests whose ``model`` names one; runtime changes apply to this API server
    (each of ``--api-server-count`` servers keeps its own set, as in vLLM)."""

    def __init__(self, config: VllmConfig, base_model_name: str):
        self.config = config.lora
        self.enabled = config.lora.enable_lora
        self.base_model_name = base_model_name
        env = os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower()
        self.runtime_updates = config.lora.runtime_updates or env in ("1", "true", "yes")
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in config.lora.modules().items():
            self.adapters[name] = LoRARequest(name, adapter_id(name, path), path, base_model_name)
        self._vllm_config = config
        self._resolvers: Optional[list[Any]] = None
        self._lock = asyncio.Lock()

    @property
    def allowed_roots(self) -> list[str]:
        return [root for root in (self.config.lora_dir, *self.config.allowed_lora_paths) if root]

    def resolvers(self) -> list[Any]:
        """The available LoRA resolver plugins, by priority (constructed on first use)."""
        if self._resolvers is None:
            from engine.interfaces.base import SelectionContext
            from engine.plugins import get_plugin_manager

            active = get_plugin_manager().active("lora_resolver", SelectionContext(self._vllm_config))
            self._resolvers = [impl.create(self._vllm_config) for impl in active]
        return self._resolvers

    def known(self, name: Optional[str]) -> bool:
        return name is None or name == self.base_model_name or name in self.adapters

    async def lookup(self, name: Optional[str], checker: Any) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names (None: the base model); an unknown name is asked of the resolvers,
        else 404."""
        if name is None or name == self.base_model_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is not None:
            return adapter
        if self.enabled:
            for resolver in self.resolvers():
                found = await resolver.resolve_lora(self.base_model_name, name)
                if found is None:
                    continue
                adapter = LoRARequest(name, adapter_id(name, found.lora_path), found.lora_path, self.base_model_name)
                await self._check(adapter, checker)
                async with self._lock:
                    adapter = self.adapters.setdefault(name, adapter)
                logger.info("LoRA adapter %s resolved by '%s': %s", name, resolver.name, adapter.lora_path)
                return adapter
        served = [self.base_model_name, *self.adapters]
        raise APIError(f"The model `{name}` does not exist. Served: {served}", 404, "model", "NotFoundError")

    @staticmethod
    async def _check(adapter: LoRARequest, checker: Any) -> None:
        if checker is None:
            raise APIError("LoRA adapters are not served here", 400, "lora_name")
        try:
            await asyncio.to_thread(checker.check, adapter)
        except LoRAAdapterError as exc:
            raise APIError(str(exc), 400, "lora_path") from None

    def _require_updates(self) -> None:
        if not self.enabled:
            raise APIError("LoRA is off: start the server with --enable-lora", 400, err_type="BadRequestError")
        if not self.runtime_updates:
            raise APIError(
                "runtime LoRA updates are off: start the server with --enable-lora-runtime-updates (or "
                f"{RUNTIME_UPDATES_ENV}=true)",
                404,
                err_type="NotFoundError",
            )

    async def load(self, name: str, path: str, checker: Any, client: str) -> LoRARequest:
        """Serve the adapter in folder ``path`` as ``name`` (an admin action): 403 for a folder outside the allowed
        ones, 400 for a name in use or a bad adapter."""
        self._require_updates()
        if not name or name == self.base_model_name:
            raise APIError(f"lora_name must be a name other than the base model's, got {name!r}", 400, "lora_name")
        if not path_within(path, self.allowed_roots):
            logger.warning("LoRA load refused: %s asked for %r, outside the allowed folders", client, path)
            allowed = self.allowed_roots or ["(none: set --lora-dir or --allowed-lora-paths)"]
            raise APIError(
                f"lora_path {path!r} is outside the folders adapters may be loaded from: {allowed}",
                403,
                "lora_path",
                "PermissionDeniedError",
            )
        adapter = LoRARequest(name, adapter_id(name, path), path, self.base_model_name)
        async with self._lock:
            if name in self.adapters:
                raise APIError(f"the LoRA adapter {name!r} is already loaded; unload it first", 400, "lora_name")
            await self._check(adapter, checker)
            self.adapters[name] = adapter
        logger.info("LoRA adapter %s loaded from %s (by %s)", name, path, client)
        return adapter

    async def unload(self, name: str, client: str) -> None:
        """Stop serving ``name`` to new requests; the requests already running with it finish with it."""
        self._require_updates()
        async with self._lock:
            if self.adapters.pop(name, None) is None:
                raise APIError(f"the LoRA adapter {name!r} is not loaded", 404, "lora_name", "NotFoundError")
        logger.info("LoRA adapter %s unloaded (by %s)", name, client)

    def models(self) -> list[dict[str, Any]]:
        """The ``/v1/models`` entries of the adapters."""
        return [
            {"id": name, "object": "model", "owned_by": "engine", "root": a.lora_path, "parent": self.base_model_name}
            for name, a in self.adapters.items()
        ]

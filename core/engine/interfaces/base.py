"""What every pluggable implementation shares: a name, a priority and its reasons not to run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.model.model_info import ModelInfo


@dataclass
class SelectionContext:
    """What an implementation may look at to decide whether it can serve."""

    config: VllmConfig
    model_info: Optional[ModelInfo] = None
    num_kv_cache_groups: Optional[int] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        from engine.devices import resolve_device

        return resolve_device(self.config.device.device)


class Pluggable:
    """Base of every implementation class a hook returns."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0

    @classmethod
    def unavailable_reasons(cls, ctx: SelectionContext) -> list[str]:
        """Why this implementation cannot run in ``ctx`` (empty list: it can)."""
        return []

    @classmethod
    def preferred_for(cls, ctx: SelectionContext) -> bool:
        """Whether ``auto`` may pick this implementation in ``ctx``."""
        return True

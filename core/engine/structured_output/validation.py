"""Front-end check of a request's constraint: refused before it is accepted (HTTP 400), never served open."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

from engine.config import ConfigError
from engine.errors import InvalidParameterError
from engine.interfaces.base import SelectionContext
from engine.plugins import get_plugin_manager

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.interfaces.structured_output import StructuredOutputBackend
    from engine.model.model_info import ModelInfo
    from engine.sampling_params import StructuredOutputsParams

MAX_VERDICTS = 256


class StructuredOutputsValidator:
    """Asks the configured backend (``structured_outputs.backend``) whether it can compile a constraint."""

    def __init__(self, vllm_config: VllmConfig, model_info: Optional[ModelInfo] = None):
        self.vllm_config = vllm_config
        self.model_info = model_info
        self._backend_cls: Optional[type[StructuredOutputBackend]] = None
        self._verdicts: OrderedDict[tuple[str, str], Optional[str]] = OrderedDict()  # (kind, spec) -> error

    def backend_cls(self) -> type[StructuredOutputBackend]:
        """The backend class the engine core will use (InvalidParameterError when none can run here)."""
        if self._backend_cls is None:
            try:
                impl = get_plugin_manager().select(
                    "structured_output",
                    self.vllm_config.structured_outputs.backend,
                    SelectionContext(self.vllm_config, self.model_info),
                )
            except ConfigError as exc:
                raise InvalidParameterError(
                    f"structured outputs are not available on this server: {exc}", "structured_outputs"
                ) from None
            self._backend_cls = impl.cls
        return self._backend_cls

    def validate(self, params: StructuredOutputsParams) -> None:
        """InvalidParameterError naming the problem (and the backend) unless the constraint can be compiled."""
        key = (params.kind, params.spec())
        if key not in self._verdicts:
            try:
                self.backend_cls().validate(params)
                error = None
            except InvalidParameterError:
                raise
            except ValueError as exc:
                error = str(exc)
            self._verdicts[key] = error
            while len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
        error = self._verdicts[key]
        if error is not None:
            raise InvalidParameterError(error, "structured_outputs")

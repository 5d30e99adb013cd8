"""Plugin manager: built-in plugins plus every installed ``engine.plugins`` entry point.

Built-ins register through the same hooks as third-party packages, so there is one path for every
implementation. ``PluginManager.select`` picks an implementation by name (or ``auto``) and, when it
cannot, fails with the reasons and the names that would work.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import pluggy

from engine import hookspecs
from engine.config import ConfigError
from engine.hookspecs import KINDS
from engine.interfaces.base import SelectionContext

if TYPE_CHECKING:
    from engine.model.registry import ModelRegistry

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "engine.plugins"
BUILTIN_MODULES = (
    "engine.attention.torch_backend",
    "engine.kv_cache.coordinators",
    "engine.sample.default_sampler",
    "engine.sample.builtin_logits_processors",
    "engine.pooling.poolers",
    "engine.model.layers.native_kernels",
    "engine.quantization.methods",
    "engine.spec_decode.ngram",
    "engine.spec_decode.suffix",
    "engine.spec_decode.draft_model",
    "engine.tool_parsers.hermes",
    "engine.reasoning.think_tags",
    "engine.lora.resolvers",
    "engine.model.registry",
)


@functools.cache
def kind_base_class(kind: str) -> type:
    """The base class that the declaration of ``kind`` names (imported on first use)."""
    module_name, _, class_name = KINDS[kind].base.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


@dataclass(frozen=True)
class Implementation:
    """A class offered by a plugin, with the distribution it came from."""

    kind: str
    name: str
    cls: Any  # a Pluggable subclass; a model family not imported yet: its "module:Class" path
    source: str
    contract: str = hookspecs.CONTRACT_VERSION  # the contract its plugin declares

    def create(self, *args, **kwargs):
        """An instance, wrapped in an adapter when its plugin speaks an older 1.x contract of this kind."""
        from engine.interfaces.legacy import adapt_for_contract

        return adapt_for_contract(self.kind, self.cls(*args, **kwargs), self.name, self.source, self.contract)

    def reasons(self, ctx: SelectionContext) -> list[str]:
        base: Any = kind_base_class(self.kind)
        if not (isinstance(self.cls, type) and issubclass(self.cls, base)):
            return [
                f"{self.cls!r} is not a subclass of {base.__module__}.{base.__qualname__}, as a {self.kind} must be"
            ]
        pluggable: Any = self.cls  # a subclass of the kind's base: it states its own reasons
        reasons = []
        # kinds whose parts decide a request's bits (attention, layer kernels) declare batch invariance
        why_not_invariant = getattr(pluggable, "batch_invariant_unsupported_reason", None)
        if why_not_invariant and ctx.config.model.batch_invariant:
            reasons.append(f"batch_invariant: {why_not_invariant}")
        try:
            return reasons + list(pluggable.unavailable_reasons(ctx))
        except Exception as exc:  # a plugin's check must not take the engine down
            return [f"availability check raised {type(exc).__name__}: {exc}"]


@dataclass(frozen=True)
class RefusedPlugin:
    """An entry point that could not be loaded, and why."""

    name: str
    source: str
    reason: str


def lora_kernel(kernels: Any) -> str:
    """Which batched LoRA product a LayerKernels class runs: its own ``add_lora``, or the torch reference."""
    from engine.interfaces.layer_kernels import LayerKernels

    own = getattr(kernels, "add_lora", None) is not getattr(LayerKernels, "add_lora", None)
    origin = next((c.__qualname__ for c in getattr(kernels, "__mro__", ()) if "add_lora" in vars(c)), "?")
    return f"own kernel ({origin}.add_lora)" if own else "the torch reference (grouped by adapter)"


def mla_support(backend: Any) -> str:
    """Whether an attention backend serves MLA models (DeepSeek-V2/V3): "yes", or "no: why"."""
    try:
        return "yes" if backend.get_mla_impl_cls() is not None else f"no: {backend.mla_unsupported_reason}"
    except Exception as exc:  # a plugin's check must not take the engine down
        return f"no: its MLA check raised {type(exc).__name__}: {exc}"


def _major(version: str) -> str:
    return str(version).split(".")[0]


class PluginManager:
    """Loads plugins once per process and answers which implementations exist."""

    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.sources: dict[str, str] = {}
        self.contracts: dict[str, str] = {}
        self.refused: list[RefusedPlugin] = []
        self.ignored_hooks: list[RefusedPlugin] = []  # hooks of a loaded plugin that this contract no longer has
        for module_name in BUILTIN_MODULES:
            self._register(importlib.import_module(module_name), f"builtin:{module_name}", "engine (built-in)")
        if load_entry_points:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            source = f"{dist.name} {dist.version}" if dist else ep.value
            if self.pm.has_plugin(ep.name):
                continue  # the same distribution seen twice on sys.path
            try:
                module = ep.load()
            except Exception as exc:
                self.refused.append(RefusedPlugin(ep.name, source, f"import failed: {type(exc).__name__}: {exc}"))
                logger.warning("plugin %s (%s) failed to load: %s", ep.name, source, exc)
                continue
            version = getattr(module, "ENGINE_CONTRACT_VERSION", None)
            if version is None or _major(version) != _major(hookspecs.CONTRACT_VERSION):
                reason = (
                    f"built for plugin contract {version or 'unknown (no ENGINE_CONTRACT_VERSION)'}, "
                    f"this engine speaks {hookspecs.CONTRACT_VERSION}"
                )
                self.refused.append(RefusedPlugin(ep.name, source, reason))
                logger.warning("plugin %s (%s) refused: %s", ep.name, source, reason)
                continue
            self._register(module, ep.name, source, str(version))

    def _register(self, module, plugin_name: str, source: str, contract: str = hookspecs.CONTRACT_VERSION) -> None:
        for hook, why in hookspecs.REMOVED_HOOKS.items():
            if getattr(getattr(module, hook, None), f"{hookspecs.PROJECT_NAME}_impl", None) is not None:
                self.ignored_hooks.append(RefusedPlugin(plugin_name, source, f"hook {hook} ignored: {why}"))
                logger.warning("plugin %s (%s): hook %s ignored: %s", plugin_name, source, hook, why)
        self.pm.register(module, name=plugin_name)
        self.sources[plugin_name] = source
        self.contracts[plugin_name] = contract

    def implementations(self, kind: str) -> dict[str, Implementation]:
        """Every implementation of ``kind``, by name; a name offered twice is an error. Model families are
        listed by architecture, with their class or, while it is not imported yet, its import path."""
        if not KINDS[kind].returns_classes:
            registry = self.models()
            return {
                arch: Implementation(kind, arch, registry.reference(arch), registry.sources[arch])
                for arch in registry.architectures()
            }
        found: dict[str, Implementation] = {}
        hook = getattr(self.pm.hook, KINDS[kind].hook)
        for impl in hook.get_hookimpls():
            source = self.sources.get(impl.plugin_name, impl.plugin_name)
            for cls in impl.function() or []:
                name = cls.name
                if name in found and found[name].cls is not cls:
                    raise ConfigError(
                        f"{kind} implementation '{name}' is offered by both "
                        f"{found[name].source} and {source}; uninstall one of them"
                    )
                found[name] = Implementation(
                    kind, name, cls, source, self.contracts.get(impl.plugin_name, hookspecs.CONTRACT_VERSION)
                )
        return found

    def models(self) -> ModelRegistry:
        """The model registry filled by every plugin's ``register_models``."""
        from engine.model.registry import ModelRegistry

        registry = ModelRegistry()
        for impl in self.pm.hook.register_models.get_hookimpls():  # built-ins first, plugins after
            registry._current_source = self.sources.get(impl.plugin_name, impl.plugin_name)
            impl.function(registry=registry)
        return registry

    def select(self, kind: str, requested: str, ctx: SelectionContext) -> Implementation:
        """The implementation named ``requested`` (or the best for ``auto``), or a ConfigError."""
        impls = self.implementations(kind)
        key = KINDS[kind].config_key
        available = {name: impl for name, impl in impls.items() if not impl.reasons(ctx)}
        if requested == "auto":
            candidates = [impl for impl in available.values() if impl.cls.preferred_for(ctx)]
            if not candidates:
                raise ConfigError(f"{key}=auto: no {kind} implementation can run here.\n" + self._explain(impls, ctx))
            return max(candidates, key=lambda impl: impl.cls.priority)
        if requested not in impls:
            raise ConfigError(
                f"{key}: unknown {kind} '{requested}'; choices: {sorted(impls) + ['auto']} "
                f"(available here: {sorted(available)})"
            )
        reasons = impls[requested].reasons(ctx)
        if reasons:
            raise ConfigError(
                f"{key}: {kind} '{requested}' cannot run here: {'; '.join(reasons)}. "
                f"Names that would work: {sorted(available) + ['auto']}"
            )
        return impls[requested]

    def active(self, kind: str, ctx: SelectionContext) -> list[Implementation]:
        """Every available implementation of a kind with no single choice (logits processors)."""
        impls = self.implementations(kind).values()
        return sorted((i for i in impls if not i.reasons(ctx)), key=lambda i: -i.cls.priority)

    @staticmethod
    def _explain(impls: dict[str, Implementation], ctx: SelectionContext) -> str:
        return "\n".join(f"  {name}: {'; '.join(impl.reasons(ctx)) or 'available'}" for name, impl in impls.items())

    def table(self, ctx: SelectionContext) -> list[dict[str, str]]:
        """Rows for ``engine plugins``: kind, name, source, availability, reason."""
        rows = []
        for kind, declaration in KINDS.items():
            for name, impl in sorted(self.implementations(kind).items()):
                if not declaration.returns_classes:  # a model family: registered, imported when it loads
                    loading = f"lazy ({impl.cls})" if isinstance(impl.cls, str) else "loaded"
                    rows.append(
                        {
                            "kind": kind,
                            "name": name,
                            "source": impl.source,
                            "available": "yes",
                            "reason": loading,
                            "priority": "",
                        }
                    )
                    continue
                reasons = impl.reasons(ctx)
                row = {
                    "kind": kind,
                    "name": name,
                    "source": impl.source,
                    "available": "yes" if not reasons else "no",
                    "reason": "; ".join(reasons),
                    "priority": str(impl.cls.priority),
                }
                if kind == "attention" and hasattr(impl.cls, "get_mla_impl_cls"):
                    row["mla"] = mla_support(impl.cls)
                if kind == "layer_kernels":
                    row["lora"] = lora_kernel(impl.cls)
                rows.append(row)
        for label, entries in (("(refused)", self.refused), ("(ignored hook)", self.ignored_hooks)):
            for entry in entries:
                rows.append(
                    {
                        "kind": label,
                        "name": entry.name,
                        "source": entry.source,
                        "available": "no",
                        "reason": entry.reason,
                        "priority": "",
                    }
                )
        return rows


def configured_class(kind: str, vllm_config: Any) -> Optional[type]:
    """The class of the implementation the config chooses for a kind chosen when first needed (tool and reasoning
    parsers), or None when the config turns the kind off; ConfigError when it cannot run."""
    declaration = KINDS[kind]
    assert declaration.config_key is not None
    name = vllm_config.get_key(declaration.config_key)
    if name == declaration.off_value:
        return None
    return get_plugin_manager().select(kind, name, SelectionContext(vllm_config)).cls


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (plugins load in every process that calls this)."""
    return PluginManager()

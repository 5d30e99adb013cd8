"""One Ray placement: a Ray session (joined, or started when there is none) and a packed placement group of
identical bundles, one per actor; used by the ray executor (one bundle per worker) and by Ray-placed
data-parallel engine cores (one bundle per DP rank)."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from engine.config import ConfigError

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 60


def require_ray(key: str) -> Any:
    """The ray module; ConfigError naming ``key`` (the setting that asked for Ray, and its value without Ray)
    when it is not installed."""
    try:
        import ray
    except ImportError:
        setting, _, _ = key.partition("=")
        without = {"parallel.executor": "multiproc", "parallel.data_parallel_backend": "mp"}.get(setting)
        raise ConfigError(
            f"{key} needs ray: pip install engine-executor-ray (it depends on ray)"
            + (f", or set {setting}={without}" if without else "")
        ) from None
    return ray


class RayPlacement:
    """A Ray session (joined at ``ray_address``, or started when none runs) and, once ``place`` is called, ``count``
    bundles of identical resources in a PACK placement group (ranks share a node while it has room), reserved
    before any actor starts. ``release`` gives them back, and ends Ray when this placement started it."""

    def __init__(self, ray_address: Optional[str], key: str):
        self.ray = require_ray(key)
        self.key = key  # the setting that asked for Ray, named in errors
        self.started_ray = not self.ray.is_initialized()
        if self.started_ray:
            self.ray.init(address=ray_address, include_dashboard=False, log_to_driver=True, configure_logging=False)
        self.group: Any = None

    def wants_gpus(self, device: str, num_gpus: int) -> bool:
        """Whether bundles take GPUs: ``device.device=cuda``, or ``auto`` on a cluster with ``num_gpus`` of them."""
        return device == "cuda" or (device == "auto" and self.ray.cluster_resources().get("GPU", 0) >= num_gpus)

    def place(self, bundle: dict[str, float], count: int, what: str) -> None:
        """Reserve ``count`` bundles; ConfigError, with the cluster's resources, when the cluster cannot hold them
        within ``PLACEMENT_TIMEOUT_S``."""
        from ray.util.placement_group import placement_group

        self.group = placement_group([bundle] * count, strategy="PACK")
        if not self.ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
            raise ConfigError(
                f"{self.key}: the Ray cluster cannot place {count} {what} of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S}s (resources: {self.ray.cluster_resources()})"
            )

    def strategy(self, index: int) -> Any:
        """The scheduling strategy that puts an actor on bundle ``index``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)

    def release(self) -> None:
        """Remove the placement group (kill its actors first), then end Ray if this placement started it. Safe to
        call twice."""
        if not self.ray.is_initialized():
            return
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception as exc:  # the cluster may be going away with it
                logger.debug("placement group not removed: %s", exc)
            self.group = None
        if self.started_ray:
            time.sleep(0.1)  # let the actors' kills reach the raylet before the driver goes
            self.ray.shutdown()
            self.started_ray = False

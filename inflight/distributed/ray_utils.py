"""Ray for data-parallel serving: importing it (it is an optional extra), the
data-parallel configuration, joining or starting a cluster, each replica's GPU share, and
one-line reasons from Ray's errors (which wrap a replica's own error in theirs).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

RAY_MISSING = (
    "--data-parallel-backend ray needs Ray, which is not installed: pip install 'inflight[ray]'"
)
_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # deltas are small; keep the local store small


def import_ray() -> Any:
    """The ``ray`` module, or a RuntimeError naming the extra that installs it."""
    try:
        import ray
    except ImportError as error:
        raise RuntimeError(RAY_MISSING) from error
    return ray


@dataclass(frozen=True, slots=True)
class DataParallelConfig:
    """vLLM's names: ``--data-parallel-size``, ``--data-parallel-address``."""

    data_parallel_size: int = 2
    address: str | None = None  # a running cluster ("auto", "ray://..."); None: a local one
    num_cpus_per_replica: float = 1.0
    torch_threads_per_replica: int | None = None  # default: this machine's cores / size
    max_restarts: int = 4
    health_check_interval_s: float = 0.5
    health_check_timeout_s: float = 5.0
    affinity_blocks: int = 4
    affinity_slack_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")

    @property
    def torch_threads(self) -> int:
        if self.torch_threads_per_replica is not None:
            return self.torch_threads_per_replica
        return max(1, (os.cpu_count() or 1) // self.data_parallel_size)


def gpus_per_replica(ray: Any, device: str, config: DataParallelConfig) -> float:
    """The GPU share each replica reserves: one each when the cluster has enough, else an
    equal share of what it has (replicas then share devices); none on the CPU.

    Ray hides the GPUs from an actor that reserved none, so ``auto`` follows the cluster's
    GPUs, not this process's.
    """
    if device == "cpu":
        return 0.0
    total = float(ray.cluster_resources().get("GPU", 0))
    if total <= 0:
        if device.startswith("cuda"):
            raise ValueError(f"--device {device}: the Ray cluster has no GPU")
        return 0.0
    share = min(1.0, total / config.data_parallel_size)
    if share < 1.0:
        logger.warning(
            "%d replicas on %g GPU(s): each replica gets %.2f of a GPU",
            config.data_parallel_size, total, share,
        )
    return share


def init_ray(ray: Any, config: DataParallelConfig) -> bool:
    """Join ``config.address``, or start a small local cluster on loopback; True if we
    started it (so we stop it too)."""
    if ray.is_initialized():
        return False
    if config.address is not None:
        ray.init(address=config.address, include_dashboard=False, log_to_driver=False)
        return False
    needed = config.data_parallel_size * config.num_cpus_per_replica
    ray.init(
        address="local",
        num_cpus=max(int(needed + 0.999), os.cpu_count() or 1),
        include_dashboard=False,
        object_store_memory=_OBJECT_STORE_BYTES,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    return True


def error_reason(error: BaseException) -> str:
    """The error's first line (its type's name if it has no message)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def error_cause(error: BaseException) -> str:
    """The innermost error's last line (Ray wraps a replica's error in its own)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line]
    return (errors or lines or [type(error).__name__])[-1].strip()

"""How many GPUs each Ray replica reserves (a fake cluster: no ray needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from inflight.distributed.client import DataParallelConfig, gpus_per_replica


def _cluster(gpus: float) -> Any:
    return SimpleNamespace(cluster_resources=lambda: {"CPU": 16.0, "GPU": gpus} if gpus else {"CPU": 16.0})


def test_one_gpu_each_when_the_cluster_has_enough() -> None:
    assert gpus_per_replica(_cluster(4), "auto", DataParallelConfig(2)) == 1.0
    assert gpus_per_replica(_cluster(4), "cuda", DataParallelConfig(4)) == 1.0


def test_replicas_share_gpus_when_there_are_fewer() -> None:
    assert gpus_per_replica(_cluster(1), "auto", DataParallelConfig(2)) == 0.5


def test_cpu_replicas_reserve_no_gpu() -> None:
    assert gpus_per_replica(_cluster(4), "cpu", DataParallelConfig(2)) == 0.0
    assert gpus_per_replica(_cluster(0), "auto", DataParallelConfig(2)) == 0.0


def test_cuda_without_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="no GPU"):
        gpus_per_replica(_cluster(0), "cuda", DataParallelConfig(2))

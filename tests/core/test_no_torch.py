"""The pure core must import and schedule with torch unavailable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import importlib
    import importlib.abc
    import pkgutil
    import sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in the pure core (import of {name})")
            return None

    sys.meta_path.insert(0, BlockTorch())
    sys.modules.pop("torch", None)

    import inflight.core

    modules = ["inflight.config", "inflight.sampling_params"] + [
        info.name
        for info in pkgutil.walk_packages(inflight.core.__path__, "inflight.core.")
    ]
    for name in modules:
        importlib.import_module(name)

    from inflight.config import SchedulerConfig
    from inflight.core.interface import ModelRunnerOutput
    from inflight.core.kv_cache_manager import KVCacheManager
    from inflight.core.request import Request
    from inflight.core.scheduler import Scheduler
    from inflight.sampling_params import SamplingParams

    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4), KVCacheManager(8, 2)
    )
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3)))
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {s.request_id: 7 for s in out.scheduled if s.sample}
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        scheduler.check_invariants()
        steps += 1
        assert steps < 100
    assert scheduler.kv_cache.num_free_blocks == 8
    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
    print("OK", len(modules), "modules,", steps, "steps")
    """
)


def test_core_imports_and_schedules_without_torch() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.startswith("OK"), proc.stdout


def test_blocking_really_blocks_torch() -> None:
    """Guard against a silently broken blocker: importing torch itself must fail."""
    script = SCRIPT.split("import inflight.core")[0] + "import torch\n"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr

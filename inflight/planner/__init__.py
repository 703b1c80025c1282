"""The capacity planner: a step cost model, calibration, and a simulator that replays
workloads through the real scheduler on a virtual clock (see docs/planner.md)."""

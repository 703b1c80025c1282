"""The CPU facts read from /proc/cpuinfo (the kernel build's cache key, the reports)."""

from __future__ import annotations

from pathlib import Path

from inflight.cpu_info import cpu_flags, cpu_model_name

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu avx512f avx512_bf16 avx512_vnni
"""


def test_reads_the_first_processors_name_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_model_name(path) == "AMD EPYC 9R14 96-Core Processor"
    assert cpu_flags(path) == {"fpu", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert "amx_bf16" not in cpu_flags(path)


def test_a_missing_file_gives_no_flags_and_the_platform_name(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    assert cpu_flags(missing) == frozenset()
    assert cpu_model_name(missing)  # platform.processor() or machine(), never empty here

"""``environment.json``: what software and hardware a run ran on, beside its ``config.yaml``."""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_commit(source: Path | None = None) -> dict[str, Any] | None:
    """The commit (and whether the tree had changes) when fedistill runs from a git checkout; else None."""
    where = source or Path(__file__).resolve().parents[3]
    if not (where / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets that decide how fast (and, through the kernels torch picks, in what order of summation)
# a run's arithmetic goes: two hosts under one name ("AMD EPYC") differed 3-3.6x in a round of the same fd-hetero
# run (Local, FedProto), one with AVX-512 and bf16 (family 25 model 17), one with AVX2 only (family 25 model 1).
TIMING_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_identity(cpuinfo: str | None = None) -> str:
    """The CPU as far as a timing depends on it: its name, family and model, and which of ``TIMING_FLAGS`` it
    has, e.g. ``AMD EPYC (family 25 model 17; avx2 avx512f avx512_bf16)``. Read from ``/proc/cpuinfo`` (or the
    text given); elsewhere the platform's processor name alone."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return cpu_name()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block describes them all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    family, model = fields.get("cpu family"), fields.get("model")
    where = f"family {family} model {model}" if family and model else ""
    present = " ".join(f for f in TIMING_FLAGS if f in flags)
    detail = "; ".join(part for part in (where, present or ("no avx2" if flags else "")) if part)
    return f"{name} ({detail})" if detail else name


def environment_info(cfg: Any) -> dict[str, Any]:
    """Versions, the git commit of a checkout, threads, precision, device and the CPU/GPU names."""
    from .. import __version__

    gpu = torch.cuda.get_device_name(torch.device(cfg.run.device)) if cfg.run.device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "fedistill": __version__,
        "git": git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "flwr": _version("flwr"),
        "numpy": _version("numpy"),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_id": cpu_identity(),  # two hosts of one name may differ in speed: compare timings within one cpu_id
        "cpu_count": __import__("os").cpu_count(),
        "gpu": gpu,
        "device": cfg.run.device,
        "precision": cfg.run.precision,
        "torch_threads": torch.get_num_threads(),
        "run_threads": cfg.run.threads,
        "workers": cfg.run.workers,
    }

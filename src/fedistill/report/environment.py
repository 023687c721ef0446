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
        "cpu_count": __import__("os").cpu_count(),
        "gpu": gpu,
        "device": cfg.run.device,
        "precision": cfg.run.precision,
        "torch_threads": torch.get_num_threads(),
        "run_threads": cfg.run.threads,
        "workers": cfg.run.workers,
    }

"""Flower adapter safety: client state is loaded without running pickled code; keys stay out of git."""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed: pip install 'fedistill[flower]' (flwr==1.41.0)")

from flwr.app import ConfigRecord, RecordDict  # noqa: E402

from fedistill.errors import ConfigError  # noqa: E402
from fedistill.flower.records import load_client_state, record_to_state, save_client_state  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: the file appears only if the pickle's code runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_client_state_with_a_pickled_object_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pickle-code-ran"
    buffer = io.BytesIO()
    torch.save({"c_i": torch.zeros(3), "evil": _Payload(marker)}, buffer)
    store = RecordDict()
    store.config_records["fedistill.client_state.0"] = ConfigRecord({"torch": buffer.getvalue()})

    with pytest.raises(ConfigError, match=r"client 0's state in context.state holds objects other than tensors and plain data") as info:
        load_client_state(store, 0)
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_client_state_damaged_or_foreign_records_are_refused():
    with pytest.raises(ConfigError, match="cannot be read"):
        record_to_state(ConfigRecord({"torch": b"not a torch file"}))
    buffer = io.BytesIO()
    torch.save([1, 2, 3], buffer)
    with pytest.raises(ConfigError, match="is a list, not a dict"):
        record_to_state(ConfigRecord({"torch": buffer.getvalue()}))


def test_client_state_of_plain_data_still_round_trips():
    state = {"c_i": torch.randn(4), "step": 3, "lr": 0.5, "name": "x", "flags": (True, None), "nested": {"m": [torch.ones(2)]}}
    store = RecordDict()
    save_client_state(store, 2, state)
    back = load_client_state(store, 2)
    assert torch.equal(back["c_i"], state["c_i"]) and back["step"] == 3 and back["flags"] == (True, None)
    assert torch.equal(back["nested"]["m"][0], torch.ones(2))


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and the repository")
@pytest.mark.parametrize(
    "path",
    ["certificates/ca.key", "certificates/server.key", "certificates/ca.crt", "flower-app/pyproject.toml", "flower-app-ray/pyproject.toml"],
)
def test_readme_tls_keys_and_generated_app_directories_are_ignored_by_git(path):
    """The README makes certificates/ and the app directories in the repository root: never committable."""
    done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, capture_output=True)
    assert done.returncode == 0, f"{path} is not ignored by .gitignore"

import os

import pytest
import torch
from torch import nn

from sparsekit.io.files import (
    atomic_torch_save,
    atomic_write,
    move_aside,
    safe_torch_load,
    unique_dir,
)
from sparsekit.nn.calibration import call_model, run_calibration
from sparsekit.errors import FileFormatError, UnsafeFileError
from sparsekit.nn.select import select_modules


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_torch_save({"a": torch.ones(2)}, path)

    def broken(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert torch.equal(safe_torch_load(path)["a"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temp file left behind


def test_safe_load_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"f": os.getcwd, "t": torch.ones(1)}, path)
    with pytest.raises(UnsafeFileError, match=r"evil.pt holds pickled objects \(posix.getcwd\)"):
        safe_torch_load(path)


def test_atomic_write_follows_umask_and_removes_orphans(tmp_path):
    path = tmp_path / "out.json"
    stale = tmp_path / ".out.json.abc123.tmp"  # a writer killed an hour ago
    fresh = tmp_path / ".out.json.def456.tmp"  # a writer that may still be running
    other = tmp_path / ".other.json.abc123.tmp"  # another file's
    for p in (stale, fresh, other):
        p.write_text("x")
    old = os.stat(stale).st_mtime - 3600
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    saved = os.umask(0o027)
    try:
        atomic_write(path, lambda tmp: open(tmp, "w").write("{}"))
    finally:
        os.umask(saved)
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert not stale.exists() and fresh.exists() and other.exists()


def test_atomic_write_keeps_previous_and_moves_damaged_aside(tmp_path):
    path, prev = tmp_path / "last.pt", tmp_path / "last.prev.pt"
    atomic_torch_save({"v": 1}, path, previous=prev)
    atomic_torch_save({"v": 2}, path, previous=prev)
    assert safe_torch_load(prev)["v"] == 1 and safe_torch_load(path)["v"] == 2
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(FileFormatError, match="last.pt is not a readable torch file"):
        safe_torch_load(path)
    moved = move_aside(path)
    assert moved.name.startswith("last.pt.corrupt-") and not path.exists()


def test_unique_dir_never_shares(tmp_path):
    made = [unique_dir(tmp_path / "runs" / "2026-01-01_00-00-00") for _ in range(3)]
    assert [p.name for p in made] == ["2026-01-01_00-00-00", "2026-01-01_00-00-00_1",
                                      "2026-01-01_00-00-00_2"]


def test_select_globs_regex_and_types():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    assert list(select_modules(model)) == ["0", "3"]
    assert list(select_modules(model, include=["re:3"])) == ["3"]
    assert list(select_modules(model, exclude="0")) == ["3"]
    with pytest.raises(ValueError, match="'9' matches no"):
        select_modules(model, include=["9"])


def test_call_model_batch_forms():
    class Two(nn.Module):
        def forward(self, a, b=0):
            return a + b

    m = Two()
    x = torch.ones(2)
    assert torch.equal(call_model(m, x), x)
    assert torch.equal(call_model(m, (x, x)), 2 * x)
    assert torch.equal(call_model(m, {"a": x, "b": x}), 2 * x)
    assert torch.equal(call_model(m, [x], lambda model, b: model(b[0], b[0])), 2 * x)
    with pytest.raises(TypeError, match="calibration_fn"):
        call_model(m, 3)
    with pytest.raises(ValueError, match="no batches"):
        run_calibration(m, [])

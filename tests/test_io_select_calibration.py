import os

import pytest
import torch
from torch import nn

from sparsekit._io import atomic_torch_save, atomic_write, safe_torch_load
from sparsekit.calibration import call_model, run_calibration
from sparsekit.select import select_modules


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
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        safe_torch_load(path)


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

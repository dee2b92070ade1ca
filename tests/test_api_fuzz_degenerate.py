"""The public verbs over degenerate modules (zero-size, meta, tied and shared weights,
non-contiguous, already pruned or quantized, fp16/bf16 calibration batches): each call either
raises a sparsekit error that names the input, or gives a result that passes an invariant check
(the pattern holds, outputs are finite, a save/load round trip is exact)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import SparsekitError


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight  # one Parameter in two layers

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.fc(torch.relu(self.fc(x))))  # the same layer called twice


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def zero_size() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 0), nn.Linear(0, 4))


def meta() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8, device="meta"), nn.ReLU(), nn.Linear(8, 4, device="meta"))


def non_contiguous() -> nn.Module:
    m = mlp()
    with torch.no_grad():
        m[0].weight = nn.Parameter(torch.randn(8, 16).t())  # a transposed view: strides (1, 16)
    assert not m[0].weight.is_contiguous()
    return m


def pruned() -> nn.Module:
    m = mlp()
    sk.prune_(m, pattern="2:4")
    return m


def quantized() -> nn.Module:
    m = mlp()
    sk.quantize_(m, "int8")
    return m


def half(dtype: torch.dtype):
    def build() -> nn.Module:
        return mlp().to(dtype)

    build.__name__ = f"mlp_{str(dtype).removeprefix('torch.')}"
    return build


MODELS = [zero_size, meta, Tied, Shared, non_contiguous, pruned, quantized,
          half(torch.float16), half(torch.bfloat16)]


def batches(model: nn.Module) -> list[torch.Tensor]:
    p = next(model.parameters(), None)
    dtype = torch.float32 if p is None or not p.is_floating_point() else p.dtype
    return [torch.randn(4, 8, dtype=dtype) for _ in range(2)]


def finite_outputs(model: nn.Module) -> None:
    p = next(model.parameters(), None)
    if p is None or p.device.type == "meta":
        return
    with torch.no_grad():
        x = batches(model)[0]
        try:
            out = model(x)
        except RuntimeError as e:  # fp16 GEMMs are missing on some CPU builds
            if "not implemented for 'Half'" in str(e):
                return
            raise
    assert torch.isfinite(out.float()).all()


def check_nm(model: nn.Module, report) -> None:
    for name in report.layers:
        if name in report.skipped:
            continue
        w = model.get_submodule(name).weight.detach()
        groups = w.float().reshape(w.shape[0], -1, 4)
        assert ((groups != 0).sum(-1) <= 2).all(), name


def named_error(err: SparsekitError, model: nn.Module) -> None:
    text = str(err)
    assert "\n" not in text and len(text) < 600, text
    names = [n for n, _ in model.named_modules()] + ["include", "sparsity", "calibration"]
    assert any(repr(n) in text or n and n in text for n in names) or "layer" in text, text


VERBS = ["prune_", "prune_wanda", "pruner", "quantize_", "quantize_static", "prune_channels_",
         "save_load"]


def act(verb: str, model: nn.Module, tmp_path) -> None:
    if verb == "prune_":
        report = sk.prune_(model, pattern="2:4")
        check_nm(model, report)
    elif verb == "prune_wanda":
        report = sk.prune_(model, pattern="2:4", criterion="wanda", calibration=batches(model))
        check_nm(model, report)
    elif verb == "pruner":
        pruner = sk.Pruner(model, 0.5, schedule=sk.Linear(start=0, end=2, every=1))
        for step in range(3):
            pruner.step(step)
        report = pruner.report()
        pruner.finalize()
        for name in report.layers:
            if name not in report.skipped:
                w = model.get_submodule(name).weight
                assert float((w == 0).float().mean()) >= 0.5 - 1e-6, name
    elif verb == "quantize_":
        sk.quantize_(model, "int8_weight_only", calibration=batches(model))
    elif verb == "quantize_static":
        sk.quantize_(model, "int8_static", calibration=batches(model))
    elif verb == "prune_channels_":
        before = sum(p.numel() for p in model.parameters())
        sk.prune_channels_(model, batches(model)[0], ratio=0.5, round_to=1)
        assert sum(p.numel() for p in model.parameters()) <= before
    elif verb == "save_load":
        path = tmp_path / "m.safetensors"
        want = {k: v.clone() for k, v in model.state_dict().items()}
        sk.save(model, path)
        fresh = type(model)() if not isinstance(model, nn.Sequential) else None
        back = sk.load(path, fresh) if fresh is not None else sk.load(path, _rebuild(model))
        got = back.state_dict()
        assert set(got) == set(want)
        for k, v in want.items():
            if v.device.type != "meta":
                assert torch.equal(got[k], v), k
        return
    finite_outputs(model)


def _rebuild(model: nn.Module) -> nn.Module:
    """A fresh module of ``model``'s architecture for sk.load (plans rebuild the rest)."""
    fresh = mlp() if len(model) == 3 else zero_size()
    p = next(model.parameters(), None)
    return fresh.to(p.dtype) if p is not None and p.is_floating_point() else fresh


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("build", MODELS, ids=lambda b: getattr(b, "__name__", str(b)))
def test_verb_on_degenerate_module(verb, build, tmp_path):
    model = build()
    try:
        act(verb, model, tmp_path)
    except SparsekitError as e:
        named_error(e, model)


CALIBRATED = {
    "wanda": lambda m, cal: sk.prune_(m, pattern="2:4", criterion="wanda", calibration=cal),
    "sparsegpt": lambda m, cal: sk.prune_(m, pattern="2:4", criterion="sparsegpt",
                                          calibration=cal),
    "int8_static": lambda m, cal: sk.quantize_(m, "int8_static", calibration=cal),
    "int8": lambda m, cal: sk.quantize_(m, "int8", calibration=cal),
}


@pytest.mark.parametrize("verb", CALIBRATED)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_calibration_batches(verb, model_dtype, batch_dtype):
    """fp16/bf16 batches to an fp32 model (and the reverse): a ModelCallError naming the layer
    and the batch; matching dtypes: the pattern holds and outputs stay finite."""
    model = mlp().to(model_dtype)
    cal = [torch.randn(4, 8, dtype=batch_dtype) for _ in range(2)]
    try:
        result = CALIBRATED[verb](model, cal)
    except SparsekitError as e:
        assert model_dtype != batch_dtype, e  # matching dtypes must work
        assert "layer '0'" in str(e) and "batch" in str(e) and "\n" not in str(e)
        return
    assert model_dtype == batch_dtype, verb  # a mismatch is never silently accepted
    if verb in ("wanda", "sparsegpt"):
        check_nm(model, result)
    finite_outputs(model)

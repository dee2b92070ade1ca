"""Block reconstruction (``reconstruct_steps`` of sparsegpt and alps): against the float64
least-squares solution of a one-layer block with the mask fixed, and on a residual two-block
toy: the masks hold, the dense model's outputs are approached, errors and warnings are clear."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import UsageError
from sparsekit.prune.reconstruct import Reconstruct, reconstruct_block


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, residual: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width) if residual else None
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.residual:
            return self.up(x)
        return x + self.down(torch.relu(self.up(x)))


class Toy(nn.Module):
    def __init__(self, blocks: int, width: int = 16, hidden: int = 32,
                 residual: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, hidden, residual) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def masked_least_squares(x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor):
    """Per output row r: argmin over (w_r on keep_r, b_r) of ||x[:, keep_r] w_r + b_r - y_r||^2,
    in float64 (the exact optimum reconstruction converges to for a linear block)."""
    x, y = x.double(), y.double()
    w = torch.zeros(keep.shape, dtype=torch.float64)
    b = torch.zeros(keep.shape[0], dtype=torch.float64)
    for r in range(keep.shape[0]):
        cols = keep[r].nonzero().squeeze(1)
        a = torch.cat([x[:, cols], torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
        sol = torch.linalg.lstsq(a, y[:, r : r + 1]).solution.squeeze(1)
        w[r, cols], b[r] = sol[:-1], sol[-1]
    return w, b


def test_linear_block_reaches_the_float64_masked_least_squares_optimum():
    torch.manual_seed(0)
    model = Toy(1, width=16, hidden=8, residual=False)
    dense = copy.deepcopy(model)
    x = torch.randn(512, 16) @ torch.randn(16, 16)  # correlated inputs: the refit matters
    criterion = {"reconstruct_steps": 3000, "reconstruct_lr": 0.02}
    sk.prune_(model, pattern="2:4", criterion="sparsegpt", calibration=[x],
              criterion_options=criterion)
    layer = model.layers[0].up
    keep = layer.weight != 0
    assert int(keep.sum()) == layer.weight.numel() // 2
    w_ref, b_ref = masked_least_squares(x, dense(x).detach(), keep)
    torch.testing.assert_close(layer.weight.double(), w_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(layer.bias.double(), b_ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("criterion", ["sparsegpt", "alps"])
def test_reconstruction_brings_a_residual_model_closer_to_dense(criterion):
    torch.manual_seed(1)
    base = Toy(3)
    dense = copy.deepcopy(base)
    calib = [torch.randn(64, 16) for _ in range(4)]
    test = torch.randn(256, 16)
    options = {"iters": 60} if criterion == "alps" else {}
    plain = copy.deepcopy(base)
    sk.prune_(plain, pattern="2:4", criterion=criterion, calibration=calib,
              criterion_options=options)
    refit = copy.deepcopy(base)
    sk.prune_(refit, pattern="2:4", criterion=criterion, calibration=calib,
              criterion_options={**options, "reconstruct_steps": 400, "reconstruct_lr": 5e-3})
    with torch.no_grad():
        ref = dense(test)
        err_plain = float((plain(test) - ref).pow(2).mean())
        err_refit = float((refit(test) - ref).pow(2).mean())
    assert err_refit < 0.7 * err_plain, (err_refit, err_plain)
    # the first block is solved from the same inputs, so its masks are the same: the refit
    # keeps them (later blocks are calibrated on refitted outputs and may choose others)
    for name in ("up", "down"):
        first_plain = getattr(plain.layers[0], name).weight
        first_refit = getattr(refit.layers[0], name).weight
        assert torch.equal(first_plain != 0, first_refit != 0)
    for layer in refit.modules():
        if isinstance(layer, nn.Linear):
            groups = (layer.weight != 0).reshape(layer.weight.shape[0], -1, 4).sum(-1)
            assert bool((groups <= 2).all())


def test_reconstruct_block_keeps_zeros_and_records_its_cost():
    torch.manual_seed(2)
    block = Block(8, 16, residual=True)
    target_block = copy.deepcopy(block)
    keep = torch.rand(16, 8) > 0.5
    with torch.no_grad():
        block.up.weight.mul_(keep)
    items = [(torch.randn(32, 8),) for _ in range(3)]
    targets = [target_block(it[0]).detach() for it in items]
    settings = Reconstruct(steps=200, lr=1e-2)
    reconstruct_block(block, lambda b, it: b(it[0]), items, targets, {"up.weight": keep},
                      settings)
    assert bool((block.up.weight[~keep] == 0).all())
    assert settings.blocks == 1 and settings.seconds > 0
    assert settings.loss_after[0] < settings.loss_before[0]
    summary = settings.summary()
    assert summary["blocks"] == 1 and summary["block_error_after"] < summary[
        "block_error_before"]
    assert all(p.requires_grad for p in block.parameters())  # flags restored


def test_bad_options_and_models_without_blocks_are_clear():
    with pytest.raises(UsageError, match="reconstruct_steps"):
        sk.prune_(Toy(1), pattern="2:4", criterion="sparsegpt",
                  calibration=[torch.randn(8, 16)], criterion_options={"reconstruct_steps": -1})
    with pytest.raises(UsageError, match="reconstruct_lr"):
        sk.prune_(Toy(1), pattern="2:4", criterion="alps",
                  calibration=[torch.randn(8, 16)], criterion_options={"reconstruct_lr": 2.0})
    flat = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with pytest.warns(RuntimeWarning, match="block reconstruction needs"):
        sk.prune_(flat, pattern="2:4", criterion="sparsegpt", calibration=[torch.randn(8, 16)],
                  criterion_options={"reconstruct_steps": 5})

"""SparseGPT solver: against a float64 direct OBS reference, reconstruction error vs magnitude,
exact budgets, N:M validity, conv unfolding, sequential processing, and bad input."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.prune.patterns import is_nm, prune_count
from sparsekit.prune.sparsegpt import conv_columns, obs_prune, sparsegpt_prune


def structured_inputs(n: int, d: int, rank: int = 6, seed: int = 0) -> torch.Tensor:
    """``(n, d)`` inputs with structure: low-rank correlated part + noise, per-feature scales."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, d, generator=g)
    x = torch.randn(n, rank, generator=g) @ basis + 0.3 * torch.randn(n, d, generator=g)
    return x * torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``2 X X^T / n`` for row-major inputs ``(n, d)``, in float64."""
    x = x.double()
    return 2 * x.T @ x / x.shape[0]


def reference_obs(w, h, sparsity=None, nm=None, blocksize=128, percdamp=0.01):
    """The SparseGPT algorithm written directly in float64: for every column j, the inverse of
    the Hessian restricted to the not yet processed columns F = {j, j+1, ...} is computed by a
    plain matrix inverse (no Cholesky trick, no lazy batching)."""
    w, h = w.double().clone(), h.double().clone()
    rows, cols = w.shape
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    h += percdamp * h.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    hinv_f = [torch.linalg.inv(h[j:, j:]) for j in range(cols)]
    prune = torch.zeros(rows, cols, dtype=torch.bool)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        if nm is None:
            diag = torch.stack([hinv_f[j][0, 0] for j in range(i1, i2)])
            score = w[:, i1:i2] ** 2 / diag
            score[:, dead[i1:i2]] = 0
            k = prune_count(rows * i2, sparsity) - prune_count(rows * i1, sparsity)
            block = torch.zeros(rows * (i2 - i1), dtype=torch.bool)
            block[score.reshape(-1).argsort()[:k]] = True
            prune[:, i1:i2] = block.reshape(rows, i2 - i1)
        for j in range(i1, i2):
            if nm is not None and (j - i1) % nm[1] == 0:
                diag = torch.stack([hinv_f[c][0, 0] for c in range(j, j + nm[1])])
                score = w[:, j : j + nm[1]] ** 2 / diag
                score[:, dead[j : j + nm[1]]] = 0
                idx = score.argsort(dim=1)[:, : nm[1] - nm[0]]
                prune[:, j : j + nm[1]].scatter_(1, idx, True)
            p = prune[:, j]
            hf = hinv_f[j]
            w[p, j:] -= (w[p, j] / hf[0, 0]).unsqueeze(1) * hf[0].unsqueeze(0)
            w[p, j] = 0
    return w, ~prune


@pytest.mark.parametrize(("sparsity", "nm"), [(0.5, None), (0.3, None), (None, (2, 4))])
def test_matches_float64_direct_obs(sparsity, nm):
    torch.manual_seed(0)
    x = structured_inputs(200, 24)
    x[:, 5] = 0  # a dead input
    w = torch.randn(6, 24)
    h = hessian(x)
    new, keep = obs_prune(w, h.float(), sparsity, nm, blocksize=8)
    ref_w, ref_keep = reference_obs(w, h, sparsity, nm, blocksize=8)
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(new.double(), ref_w, rtol=1e-4, atol=1e-4)
    assert torch.equal(new == 0, ~keep | (w == 0))


def magnitude_prune(w: torch.Tensor, sparsity=None, nm=None) -> torch.Tensor:
    """Magnitude pruning (no weight update) with the same budget as obs_prune."""
    if nm is None:
        k = prune_count(w.numel(), sparsity)
        keep = torch.ones_like(w, dtype=torch.bool)
        keep.view(-1)[w.abs().reshape(-1).argsort()[:k]] = False
    else:
        n, m = nm
        groups = w.abs().reshape(w.shape[0], -1, m)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
        keep = keep.reshape(w.shape)
    return w * keep


@pytest.mark.parametrize(("sparsity", "nm"), [(0.5, None), (None, (2, 4))])
def test_reduces_reconstruction_error_vs_magnitude(sparsity, nm):
    torch.manual_seed(1)
    x = structured_inputs(1024, 128, seed=1)
    w = torch.randn(64, 128) / 128**0.5
    new, keep = obs_prune(w, hessian(x).float(), sparsity, nm, blocksize=32)
    mag = magnitude_prune(w, sparsity, nm)
    assert int((new == 0).sum()) == int((mag == 0).sum())  # the same mask budget
    err_sgpt = torch.linalg.norm(x @ (w - new).T)
    err_mag = torch.linalg.norm(x @ (w - mag).T)
    assert err_sgpt < 0.7 * err_mag


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2),
        nn.Conv1d(4, 6, 3, padding="same", padding_mode="reflect"),
        nn.Conv3d(3, 2, (2, 3, 1), stride=(1, 2, 1), padding=(1, 0, 1), padding_mode="circular"),
    ],
)
def test_conv_columns_reproduce_the_conv(conv):
    torch.manual_seed(0)
    x = torch.randn(2, conv.in_channels, *([7] * len(conv.kernel_size)))
    rows = conv_columns(conv, x)
    w = conv.weight.reshape(conv.out_channels, -1)
    og = conv.out_channels // conv.groups
    out = torch.cat([rows[g] @ w[g * og : (g + 1) * og].T for g in range(conv.groups)], 1)
    ref = (conv(x) - conv.bias.reshape(1, -1, *[1] * len(conv.kernel_size))).movedim(1, -1)
    torch.testing.assert_close(out, ref.reshape(-1, conv.out_channels), atol=1e-5, rtol=1e-5)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c3 = nn.Conv1d(8, 6, 2)
        self.fc = nn.Linear(6 * 15, 10)

    def forward(self, x):
        x = F.relu(self.c2(F.relu(self.c1(x))))
        x = F.relu(self.c3(x.mean(2)))
        return self.fc(x.flatten(1))


def test_exact_sparsity_per_layer():
    torch.manual_seed(0)
    net = ConvNet()
    mods = dict(net.named_children())
    levels = {"c1": 0.37, "c2": 0.5, "c3": 0.81, "fc": 0.13}
    masks = sparsegpt_prune(net, mods, levels, None, [torch.randn(4, 3, 16, 16)], blocksize=16)
    for name, mod in mods.items():
        pruned = prune_count(mod.weight.numel(), levels[name])
        assert masks[name].shape == mod.weight.shape
        assert int((~masks[name]).sum()) == pruned, name
        assert bool((mod.weight[~masks[name]] == 0).all()), name


def test_nm_validity_every_group():
    torch.manual_seed(0)
    net = ConvNet()
    mods = {"c2": net.c2, "c3": net.c3, "fc": net.fc}  # in*kernel = 36, 16, 90: 90 % 2 only
    masks = sparsegpt_prune(net, mods, {}, (1, 2), [torch.randn(4, 3, 16, 16)], blocksize=16)
    for name, mod in mods.items():
        groups = masks[name].reshape(mod.weight.shape[0], -1, 2)
        assert bool((groups.sum(-1) == 1).all()), name
        assert is_nm(mod.weight, 1, 2)
    lin = nn.Linear(64, 8)
    masks = sparsegpt_prune(lin, {"": lin}, {}, (2, 4), [torch.randn(32, 64)], blocksize=32)
    assert bool((masks[""].reshape(8, -1, 4).sum(-1) == 2).all())
    assert is_nm(lin.weight, 2, 4)


def test_sequential_layer2_hessian_comes_from_pruned_layer1():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    dense = [p.detach().clone() for p in (net[0].weight, net[0].bias, net[2].weight)]
    batches = [structured_inputs(20, 16, seed=s) for s in range(3)]
    x = torch.cat(batches)
    sparsegpt_prune(net, {"0": net[0], "2": net[2]}, {"0": 0.5, "2": 0.5}, None, batches)

    w1, _ = obs_prune(dense[0], hessian(x).float(), 0.5)
    y_pruned = F.relu(x @ w1.T + dense[1])
    w2, _ = obs_prune(dense[2], hessian(y_pruned).float(), 0.5)
    torch.testing.assert_close(net[0].weight, w1)
    torch.testing.assert_close(net[2].weight, w2, rtol=1e-5, atol=1e-5)
    # the test can tell: layer 2 solved from the dense layer-1 outputs differs
    w2_dense_inputs, _ = obs_prune(
        dense[2], hessian(F.relu(x @ dense[0].T + dense[1])).float(), 0.5
    )
    assert not torch.allclose(w2, w2_dense_inputs, atol=1e-3)


class TwoHeads(nn.Module):
    """``a`` and ``b`` read the same tensor (share a Hessian); ``c`` reads their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 4)

    def forward(self, x, scale=1.0):
        return self.c(torch.tanh(self.a(x) + self.b(x)) * scale)


def test_layers_sharing_an_input_and_dict_batches():
    torch.manual_seed(0)
    net = TwoHeads()
    dense = {
        n: (m.weight.detach().clone(), m.bias.detach().clone()) for n, m in net.named_children()
    }
    xs = [torch.randn(10, 12) for _ in range(2)]
    batches = ({"x": x, "scale": 2.0} for x in xs)  # a generator: read once
    mods = dict(net.named_children())
    sparsegpt_prune(net, mods, dict.fromkeys(mods, 0.25), None, batches)
    x = torch.cat(xs)
    wa, _ = obs_prune(dense["a"][0], hessian(x).float(), 0.25)
    wb, _ = obs_prune(dense["b"][0], hessian(x).float(), 0.25)
    y = torch.tanh(x @ wa.T + dense["a"][1] + x @ wb.T + dense["b"][1]) * 2.0
    wc, _ = obs_prune(dense["c"][0], hessian(y).float(), 0.25)
    for name, ref in (("a", wa), ("b", wb), ("c", wc)):
        torch.testing.assert_close(mods[name].weight, ref, rtol=1e-5, atol=1e-5)


def test_dead_inputs_are_pruned_first_and_stay_finite():
    lin = nn.Linear(16, 4)
    x = torch.randn(64, 16)
    x[:, :4] = 0
    masks = sparsegpt_prune(lin, {"l": lin}, {"l": 0.25}, None, [x])
    assert not bool(masks["l"][:, :4].any())
    assert bool(masks["l"][:, 4:].all())
    assert bool(torch.isfinite(lin.weight).all())


def test_bad_input():
    lin = nn.Linear(8, 4)
    x = [torch.randn(4, 8)]
    with pytest.raises(ValueError, match="calibration"):
        sparsegpt_prune(lin, {"l": lin}, {"l": 0.5}, None, [])
    with pytest.raises(ValueError, match="'l'.*sparsity"):
        sparsegpt_prune(lin, {"l": lin}, {"l": 1.5}, None, x)
    with pytest.raises(ValueError, match="percdamp"):
        sparsegpt_prune(lin, {"l": lin}, {"l": 0.5}, None, x, percdamp=0)
    with pytest.raises(ValueError, match="blocksize"):
        sparsegpt_prune(lin, {"l": lin}, {}, (2, 4), x, blocksize=6)
    with pytest.raises(ValueError, match="zero inputs"):
        sparsegpt_prune(lin, {"l": lin}, {"l": 0.5}, None, [torch.zeros(4, 8)])
    with pytest.raises(TypeError, match="Embedding"):
        emb = nn.Embedding(4, 4)
        sparsegpt_prune(emb, {"e": emb}, {"e": 0.5}, None, [torch.tensor([1])])
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    with pytest.raises(ValueError, match="out_proj.*never called"):
        q = torch.randn(2, 3, 8)
        sparsegpt_prune(mha, {"out_proj": mha.out_proj}, {"out_proj": 0.5}, None, [(q, q, q)])


def _ranks_entry(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from sparsekit.nn import shards as S

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
        ref = copy.deepcopy(net)
        batches = [structured_inputs(12 + 8 * r, 16, seed=r) for r in range(2)]  # unequal sizes
        mods = {"0": net[0], "2": net[2]}
        levels = {"0": 0.5, "2": 0.5}
        sparsegpt_prune(net, mods, levels, None, [batches[rank]], comm=S.comm())
        sparsegpt_prune(ref, {"0": ref[0], "2": ref[2]}, levels, None, batches)  # all batches
        torch.testing.assert_close(net[0].weight, ref[0].weight, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(net[2].weight, ref[2].weight, rtol=1e-4, atol=1e-5)
        open(os.path.join(out_dir, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_ranks_share_hessians():
    """Two gloo ranks, each calibrating on its own batch, reach the weights one process
    computes from both batches."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ranks_entry, args=(os.path.join(d, "init"), d), nprocs=2, join=True)
        assert all(os.path.exists(os.path.join(d, f"ok{r}")) for r in range(2))


def test_config_needs_a_oneshot_schedule_for_sparsegpt():
    from sparsekit.run.config import Config, ConfigError, validate

    cfg = Config()
    cfg.prune.criterion = "sparsegpt"  # default schedule: linear, with fine-tuning
    with pytest.raises(ConfigError, match="schedule=oneshot"):
        validate(cfg)
    cfg.schedule.kind = "oneshot"
    validate(cfg)
    cfg.schedule.kind, cfg.prune.fine_tune = "linear", False
    validate(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_weights_match_the_cpu_float32_solver():
    """On CUDA with bf16 weights and inputs, the solver runs in float32 and writes bf16 back:
    the same masks as on CPU from the same (bf16-rounded) values, weights within bf16 rounding."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 64).to(torch.bfloat16)
    x = [structured_inputs(128, 256, seed=s).to(torch.bfloat16) for s in range(2)]
    gpu, cpu = copy.deepcopy(lin).cuda(), copy.deepcopy(lin).float()
    for nm, levels in (((2, 4), {}), (None, {"l": 0.6})):
        g, c = copy.deepcopy(gpu), copy.deepcopy(cpu)
        mg = sparsegpt_prune(g, {"l": g}, levels, nm, [b.cuda() for b in x], blocksize=64)["l"]
        mc = sparsegpt_prune(c, {"l": c}, levels, nm, [b.float() for b in x], blocksize=64)["l"]
        assert g.weight.dtype == torch.bfloat16 and mg.device.type == "cuda"
        assert float((mg.cpu() == mc).float().mean()) > 0.995
        same = mg.cpu() == mc
        torch.testing.assert_close(
            g.weight.float().cpu()[same],
            c.weight.to(torch.bfloat16).float()[same],
            rtol=0.02,
            atol=0.02,
        )

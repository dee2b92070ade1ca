"""ALPS (criterion "alps"): against a float64 reference written directly from the paper's
updates (plain linear solves, an exact least-squares refit), its layer error against
SparseGPT's on the same Hessian, exact budgets, options and the registered solver."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.prune.alps import admm_prune, layer_error, pattern_project, refit
from sparsekit.prune.patterns import is_nm, prune_count
from sparsekit.prune.sparsegpt import obs_prune
from test_sparsegpt import hessian, structured_inputs


def reference_alps(w, h, sparsity=None, nm=None, percdamp=0.01, rho=0.1, iters=300):
    """ALPS in float64, directly: (H + rho I) W^T = H W0^T + rho Z^T - L^T by a linear solve
    at every step, the projection by sorting, and the kept weights of every row by their
    normal equations restricted to the support."""
    w0, h = w.double().clone(), h.double().clone()
    rows, cols = w0.shape
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w0[:, dead] = 0
    h += percdamp * h.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    s = h.diagonal().sqrt()
    hn = h / s[None, :] / s[:, None]
    v0 = w0 * s
    count = 0 if nm else prune_count(rows * cols, sparsity)

    def project(x):
        keep = torch.zeros_like(x, dtype=torch.bool)
        if nm:
            for r in range(rows):
                for g in range(0, cols, nm[1]):
                    top = x[r, g:g + nm[1]].abs().argsort(descending=True)[: nm[0]]
                    keep[r, g + top] = True
        else:
            order = x.abs().reshape(-1).argsort(descending=True)
            keep.view(-1)[order[: rows * cols - count]] = True
        return keep

    support = project(v0)
    z, keep, lam = v0 * support, support, torch.zeros_like(v0)
    eye = torch.eye(cols, dtype=torch.float64)
    for it in range(iters):
        v = torch.linalg.solve(hn + rho * eye, (v0 @ hn + rho * z - lam).T).T
        keep = project(v + lam / rho)
        z = (v + lam / rho) * keep
        lam = lam + rho * (v - z)
        if it % 3 == 2:
            changed = int((keep != support).sum()) / int(keep.sum())
            support = keep
            if changed == 0 and rho > 10:
                break
            rho *= 1.3 if changed > 0.01 else 1.2 if changed > 0.001 else 1.1
    out = torch.zeros_like(v0)
    for r in range(rows):
        k = keep[r]
        # minimise (x - v0) Hn (x - v0)^T with x zero off k: Hn_kk x_k = (v0 Hn)_k
        out[r, k] = torch.linalg.solve(hn[k][:, k], (v0[r] @ hn)[k])
    return out / s, keep


@pytest.mark.parametrize(("sparsity", "nm"), [(None, (2, 4)), (0.5, None), (0.7, None)])
def test_matches_float64_reference(sparsity, nm):
    torch.manual_seed(0)
    x = structured_inputs(300, 16)
    x[:, 3] = 0  # a dead input
    w = torch.randn(5, 16)
    h = hessian(x)
    new, keep = admm_prune(w, h.float(), sparsity, nm, cg_iters=100)
    ref_w, ref_keep = reference_alps(w, h, sparsity, nm)
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(new.double(), ref_w, rtol=1e-3, atol=1e-3)
    if nm:
        assert is_nm(new, *nm)
    else:
        assert int((~keep).sum()) == prune_count(w.numel(), sparsity)


@pytest.mark.parametrize("seed", range(4))
def test_lower_layer_error_than_sparsegpt_at_24(seed):
    torch.manual_seed(seed)
    x = structured_inputs(400, 64, rank=12, seed=seed)
    w = torch.randn(32, 64)
    h = hessian(x).float()
    sgpt, _ = obs_prune(w, h, nm=(2, 4), blocksize=64)
    alps, keep = admm_prune(w, h, nm=(2, 4))
    e_sgpt, e_alps = layer_error(sgpt, w, h), layer_error(alps, w, h)
    assert e_alps < 0.95 * e_sgpt, (float(e_alps), float(e_sgpt))


def test_refit_is_the_least_squares_solution_on_the_support():
    torch.manual_seed(0)
    h = hessian(structured_inputs(200, 12)).float()
    w0 = torch.randn(4, 12)
    keep = pattern_project(torch.randn(4, 12), (2, 4), 0)
    got = refit(w0, h, keep, iters=100)
    for r in range(4):
        k = keep[r]
        want = torch.linalg.solve(h[k][:, k].double(), (w0[r].double() @ h.double())[k])
        torch.testing.assert_close(got[r, k].double(), want, rtol=1e-4, atol=1e-4)
    assert bool((got[~keep] == 0).all())


def test_registered_solver_with_options_through_prune_():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    calib = [torch.randn(64, 16) for _ in range(2)]
    dense = copy.deepcopy(net)
    report = sk.prune_(net, pattern="2:4", criterion="alps", calibration=calib,
                       criterion_options={"iters": 60, "sequential": False})
    assert report.global_sparsity == 0.5 and all(is_nm(m.weight, 2, 4) for m in net[::2])
    sgpt = copy.deepcopy(dense)
    sk.prune_(sgpt, pattern="2:4", criterion="sparsegpt", calibration=calib,
              criterion_options={"blocksize": 16, "percdamp": 0.05})
    x = torch.cat(calib)
    with torch.no_grad():
        err = {k: float((m(x) - dense(x)).pow(2).mean()) for k, m in (("alps", net),
                                                                      ("sgpt", sgpt))}
    assert err["alps"] < err["sgpt"]
    with pytest.raises(UsageError, match=r"takes no option\(s\) \['blocksize'\]; its options"):
        sk.prune_(copy.deepcopy(dense), pattern="2:4", criterion="alps", calibration=calib,
                  criterion_options={"blocksize": 8})
    with pytest.raises(ConfigTypeError, match="option sequential='no': expected a bool"):
        sk.prune_(copy.deepcopy(dense), pattern="2:4", criterion="sparsegpt",
                  calibration=calib, criterion_options={"sequential": "no"})
    with pytest.raises(UsageError, match="percdamp=0.0 must be > 0"):
        sk.prune_(copy.deepcopy(dense), pattern="2:4", criterion="sparsegpt",
                  calibration=calib, criterion_options={"percdamp": 0.0})

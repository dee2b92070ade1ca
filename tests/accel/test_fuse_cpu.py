"""Sibling fusion's logic on CPU: which linears group, and that the fused slices give back
exactly what the separate layers computed, forward after forward."""

import pytest
import torch
from torch import nn

from sparsekit.accel import fuse


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 4), nn.Linear(8, 4, bias=False), nn.Linear(8, 6)
        self.o = nn.Linear(4, 8)  # its own input
        self.twice = nn.Linear(8, 8)  # called twice on the same input: never fused
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)  # equal values, different tensors

    def forward(self, x):
        h = x * 2
        q, k, v = self.q(h), self.k(h), self.v(h)
        y = self.o(q * k) + v.sum(-1, keepdim=True) + self.twice(h) + self.twice(h)
        return y + self.a(x.clone()).sum() + self.b(x.clone()).sum()


def names_of(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_groups_are_same_input_called_once():
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(3, 8, dtype=torch.float64)
    tokens, groups = fuse.observe(model, lambda: model(x), names_of(model))
    assert groups == [["q", "k", "v"]]
    assert tokens == {n: 3 for n in names_of(model)}
    assert fuse.observe(model, lambda: model(x), ["k", "v"])[1] == [["k", "v"]]
    assert fuse.observe(model, lambda: model(x[:2]), ["q", "o"]) == ({"q": 2, "o": 2}, [])
    assert not model.q._forward_pre_hooks  # hooks removed


def test_fused_slices_match_separate_layers():
    torch.manual_seed(0)
    model = Block().double()
    xs = [torch.randn(2, 5, 8, dtype=torch.float64) for _ in range(3)]
    refs = [model(x) for x in xs]
    members = [model.q, model.k, model.v]
    fused = fuse.fused_linear(members)
    assert fused.weight.shape == (14, 8)
    assert torch.equal(fused.bias[4:8], torch.zeros(4, dtype=torch.float64))  # k has none
    calls = []
    fused.register_forward_pre_hook(lambda m, a: calls.append(1))
    fuse.install(model, ["q", "k", "v"], fused, [4, 4, 6])
    for x, ref in zip(xs, refs):
        torch.testing.assert_close(model(x), ref, rtol=1e-12, atol=1e-12)
    assert len(calls) == 3  # one fused GEMM per forward, not three
    assert isinstance(model.q, fuse.SiblingOutput) and model.q.fused is fused
    assert sum(1 for k in model.state_dict() if k.startswith(("q.", "k.", "v."))) == 2


def test_changed_call_pattern_recomputes():
    torch.manual_seed(0)
    q, k = nn.Linear(8, 4).double(), nn.Linear(8, 4).double()
    holder = nn.Module()
    holder.q, holder.k = q, k
    x1, x2 = (torch.randn(3, 8, dtype=torch.float64) for _ in range(2))
    want = {("q", 1): q(x1), ("k", 2): k(x2), ("k", 1): k(x1), ("q", 2): q(x2)}
    fuse.install(holder, ["q", "k"], fuse.fused_linear([q, k]), [4, 4])
    # q on x1, then k on another tensor, then members again in the other order
    torch.testing.assert_close(holder.q(x1), want[("q", 1)])
    torch.testing.assert_close(holder.k(x2), want[("k", 2)])
    torch.testing.assert_close(holder.q(x2), want[("q", 2)])
    torch.testing.assert_close(holder.k(x1), want[("k", 1)])
    torch.testing.assert_close(holder.q(x1), want[("q", 1)])


def test_fused_linear_needs_one_in_features():
    with pytest.raises(ValueError, match="one in_features"):
        fuse.fused_linear([nn.Linear(8, 4), nn.Linear(6, 4)])


def test_fusion_kept_only_where_the_model_measures_faster(monkeypatch):
    """_keep_faster_fusion on recorded timings: q/k/v fused is faster, gate/up split is."""
    from sparsekit.accel import api
    from sparsekit.accel.report import AccelReport, LayerDecision

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(8, 8) for _ in range(3))
            self.gate, self.up = nn.Linear(8, 16), nn.Linear(8, 16)

        def forward(self, x):
            return self.q(x) + self.k(x) + self.v(x) + (self.gate(x) * self.up(x))[..., :8]

    torch.manual_seed(0)
    model = Two().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    ref = model(x)
    report = AccelReport("bf16", "2:4", 1.0, "test")
    fused = []
    for unit in (["q", "k", "v"], ["gate", "up"]):
        members = [model.get_submodule(n) for n in unit]
        d = LayerDecision("+".join(unit), 0, 8, 4, True, "bf16_2:4", "2:4")
        report.layers.append(d)
        fuse.install(model, unit, fuse.fused_linear(members), [m.out_features for m in members])
        fused.append((unit, members, d))

    def fake_time(fn, calls=1):  # split q/k/v: +10 us; split gate/up: -20 us
        fn()
        t = 100.0
        t += 0 if isinstance(model.q, fuse.SiblingOutput) else 10
        t += 20 if isinstance(model.gate, fuse.SiblingOutput) else 0
        return t

    monkeypatch.setattr(api, "graph_time_us", fake_time)
    monkeypatch.setattr(api, "_build", lambda variant, lin, m, searched, search: lin)
    assert api._keep_faster_fusion(model, x, fused, {}, True, report) == 100.0  # as left
    assert isinstance(model.q, fuse.SiblingOutput) and isinstance(model.v, fuse.SiblingOutput)
    assert isinstance(model.gate, nn.Linear) and isinstance(model.up, nn.Linear)
    assert "separate GEMMs" in report.layers[1].reason
    assert "separate" not in report.layers[0].reason
    assert any("gate+up (1 groups) dropped" in n for n in report.notes)
    assert any("q+k+v (1 groups) kept" in n for n in report.notes)
    torch.testing.assert_close(model(x), ref)


def test_input_written_in_place_between_siblings_is_not_fused_or_reused():
    torch.manual_seed(0)

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, h):
            y = self.a(h)
            h.mul_(2)  # the same tensor object, new values
            return y, self.b(h)

    model = InPlace().double()
    x = torch.randn(3, 8, dtype=torch.float64)
    assert fuse.observe(model, lambda: model(x.clone()), ["a", "b"])[1] == []
    # installed anyway (by hand): the slice for b is recomputed from the new values
    ref = model(x.clone())
    fuse.install(model, ["a", "b"], fuse.fused_linear([model.a, model.b]), [4, 4])
    for got, want in zip(model(x.clone()), ref):
        torch.testing.assert_close(got, want)

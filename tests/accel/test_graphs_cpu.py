"""sparsekit's own CUDA graphs (sparsekit.accel.graphs) on CPU: the input signatures, the
capture cache's decisions (with torch.cuda's graph API replaced by a recording stand-in), and
accelerate's choice of it. The real capture and replay are tested on the GPU
(tests/accel/test_accel_gpu.py)."""

import dataclasses

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit import _compat
from sparsekit.accel import AcceleratedModel, CompileOptions, graphs
from sparsekit.accel.report import AccelReport


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """What these tests compile leaves no dynamo state behind (its automatic-dynamic record of
    ``nn.Sequential.forward`` would make another test's first compile dynamic)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_input_key_tells_apart_what_a_captured_graph_depends_on():
    x = torch.zeros(2, 3)
    key = graphs.input_key
    assert key((x,)) == key((torch.ones(2, 3),))  # values are copied in: same graph
    assert key((x,)) != key((torch.zeros(3, 3),))  # shape
    assert key((x,)) != key((x.t().contiguous().t(),))  # strides
    assert key((x,)) != key((x.to(torch.bfloat16),))  # dtype
    assert key(({"a": x, "n": 1},)) != key(({"a": x, "n": 2},))  # a scalar's value
    assert key(({"a": x, "b": x},)) != key(({"b": x, "a": x},))  # keyword order
    assert key([1, True]) != key([True, 1]) and key((1,)) != key((1.0,))  # types

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor
        n: int

    assert key(Batch(x, 1)) == key(Batch(torch.ones(2, 3), 1))
    hash(key(((x, [x, None]), {"b": Batch(x, 2), "s": "cls"})))  # hashable
    # anything else (an HF Cache whose tensors the model updates in place): no signature
    assert key(({"past_key_values": object()},)) is None
    assert key((x, {"k": [x, nn.Linear(1, 1)]})) is None
    assert key(({1: x},)) is None  # non-string keys


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: counts replays."""
    replays = 0

    def replay(self):
        _FakeGraph.replays += 1


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    captured = []

    class GraphContext:
        def __init__(self, graph, pool=None):
            captured.append((graph, pool))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    import contextlib

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", GraphContext)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    _FakeGraph.replays = 0
    # cuBLAS's cached workspaces cleared: before the warm-up, before and after the capture
    monkeypatch.setattr(_compat, "clear_cublas_workspaces",
                        lambda: captured.append("clear cublas"))
    return captured


def test_graph_cache_captures_once_per_signature_and_copies_inputs_in(fake_cuda_graphs):
    calls = []

    def fn(x, scale=1.0):
        calls.append(x.shape)
        return x * scale

    cache = graphs.GraphCache(fn, max_graphs=2, warmup=2)
    out = cache.run((torch.ones(2, 3),), {"scale": 2.0})
    assert len(calls) == 3  # two warm-up calls, one captured
    (first,) = cache.graphs.values()
    assert out is first.out and _FakeGraph.replays == 1  # the capture ran nothing: replayed
    # one pool for the model's graphs; the capture owns its cuBLAS workspace (none cached
    # into the warm-up or the capture, none kept after)
    assert fake_cuda_graphs == ["clear cublas", "clear cublas", (first.graph, "pool"),
                                "clear cublas"]
    x = torch.full((2, 3), 5.0)
    assert cache.run((x,), {"scale": 2.0}) is first.out  # same signature: no new capture
    assert _FakeGraph.replays == 2 and len(cache.graphs) == 1
    assert torch.equal(first.inputs[0], x) and first.inputs[0] is not x  # copied in
    assert len(calls) == 3  # replay runs no Python of fn
    cache.run((x,), {"scale": 3.0})  # another scalar: another graph
    assert len(cache.graphs) == 2 and len(calls) == 6
    assert cache.run((torch.ones(4, 3),), {}) is None  # a third signature: over the limit
    assert "more than 2 input signatures" in cache.why
    assert cache.run(({"cache": object()},), {}) is None and "objects other" in cache.why


def test_graph_cache_refuses_a_model_with_graph_breaks(fake_cuda_graphs):
    """Capture would freeze the Python between the pieces (which may branch on data)."""

    def broken(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    cache = graphs.GraphCache(torch.compile(broken, backend="eager"))
    assert cache.run((torch.ones(3),), {}) is None
    assert "2 graphs (graph breaks)" in cache.why and cache.compiled == 2 and not cache.graphs
    torch._dynamo.reset()
    whole = graphs.GraphCache(torch.compile(lambda x: (x + 1) * 2, backend="eager"))
    assert whole.run((torch.ones(3),), {}) is not None and whole.compiled == 1


def test_accelerated_model_falls_back_to_reduce_overhead_once(monkeypatch):
    """When a call cannot be captured, the model is compiled with reduce-overhead, once, the
    report says why, and the call (and later ones) run that."""
    net = nn.Linear(8, 8).eval().to(torch.bfloat16)
    fast = AcceleratedModel(net, AccelReport("bf16", "2:4", 1.0, "cpu"), torch.device("cpu"),
                            CompileOptions(backend="eager"))
    modes = []
    monkeypatch.setattr(fast, "_compile", lambda mode: modes.append(mode) or net)

    class Refuses:
        compiled, why = 0, "inputs holding objects other than tensors and scalars"

        def run(self, args, kwargs):
            return None

    fast.__dict__["graphs"] = Refuses()
    assert fast.capture
    x = torch.randn(2, 8)
    torch.testing.assert_close(fast(x), net(x.to(torch.bfloat16)).detach())
    fast(x)
    assert modes == ["reduce-overhead"] and fast.graphs is None and fast.capture is False
    assert [n for n in fast.report.notes if n.startswith("own CUDA graphs off")] == [
        "own CUDA graphs off (inputs holding objects other than tensors and scalars): "
        "torch.compile's reduce-overhead mode replays the model instead"]


def test_capture_is_checked_and_off_on_cpu():
    net = nn.Sequential(nn.Linear(64, 64)).eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude")
    with pytest.raises(ValueError, match=r"CompileOptions\(capture=True\) needs a CUDA device"):
        sk.accelerate(net, torch.randn(4, 64), device="cpu",
                      compile=sk.CompileOptions(capture=True))
    fast = sk.accelerate(net, torch.randn(4, 64), device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    assert fast.capture is False and fast.graphs is None

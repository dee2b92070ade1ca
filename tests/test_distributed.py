"""Distributed pruning on CPU with gloo: 2 processes started by torch.multiprocessing.

All multi-process checks of one kind run inside one spawned pair, because starting processes
is what costs time here; each check asserts on every rank and failures propagate to pytest.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import sparsekit as sk
from sparsekit.nn import shards as S
from sparsekit.prune import checksums as C
from sparsekit.run import distributed as D
from sparsekit.prune.criteria import collect_input_norms, wanda
from sparsekit.prune import sparsegpt
from sparsekit.prune.masks import find_mask
from sparsekit.prune.patterns import lowest_k_masks, nm_mask
from sparsekit.prune.stores import HeldMasks, ParametrizedMasks, ShardedMasks

WORLD = 2


def _entry(rank: int, init_file: str, check: str, out_dir: str) -> None:
    # CPU ranks (gloo), also on a GPU machine: fully_shard's default mesh follows CUDA if seen
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        globals()[check](rank, out_dir)
        open(os.path.join(out_dir, f"ok{rank}"), "w").close()
        # both ranks done before either tears down its gloo connections: a rank destroying
        # its group while the other still talks aborted now and then ("terminate called...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(check: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        done = [os.path.join(d, f"ok{r}") for r in range(WORLD)]
        try:
            mp.spawn(_entry, args=(os.path.join(d, "init"), check, d), nprocs=WORLD, join=True)
        except mp.ProcessExitedException as e:
            # gloo now and then still aborts a rank in its teardown, after the barrier (CI,
            # 2026-12-03: "terminate called without an active exception"); a rank that got
            # there had passed every check and written its ok file: anything else is a failure
            if e.signal_name != "SIGABRT" or not all(map(os.path.exists, done)):
                raise
        assert all(map(os.path.exists, done))


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on all ranks), as int64."""
    out = [torch.zeros_like(t, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(out, t.to(torch.int64).contiguous())
    return out


def _full(mask: torch.Tensor) -> torch.Tensor:
    """A DTensor bool mask gathered whole (through int64: gloo has no bool collectives)."""
    return S.like(S.local(mask).long(), mask).full_tensor().bool()


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 7), nn.ReLU(), nn.Linear(7, 4))


def _batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _train(model, pruner, opt, step, x, y) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    pruner.step(step)
    return loss.detach()


# ---- checks run on every rank --------------------------------------------------------------


def check_threshold(rank: int, out_dir: str) -> None:
    """Distributed lowest-k over shards == single-process lowest-k on the whole tensors,
    with many ties and entries already pruned, and a tensor whose second shard is empty."""
    c = S.comm()
    g = torch.Generator().manual_seed(7)
    full = [
        torch.randint(0, 5, (9, 6), generator=g).float(),  # few values: ties everywhere
        torch.rand(5, 3, generator=g),
        torch.randint(0, 3, (1, 10), generator=g).float(),  # one row: rank 1 holds nothing
    ]
    keep = [torch.rand(t.shape, generator=g) > 0.2 for t in full]

    def shard(t):
        chunks = torch.chunk(t, WORLD, dim=0)
        return chunks[rank] if rank < len(chunks) else t[:0]

    total = sum(t.numel() for t in full)
    for k in (int(sum((~m).sum() for m in keep)), 40, 57, total):
        ref = lowest_k_masks(full, k, keep)
        got = lowest_k_masks([shard(t) for t in full], k, [shard(m) for m in keep], c)
        for r, gt in zip(ref, got):
            assert torch.equal(shard(r), gt), k
        assert sum(int((~m).sum()) for m in ref) == k


def check_ddp(rank: int, out_dir: str) -> None:
    """DDP: masks identical on both ranks at every update, names without 'module.', losses equal
    to a one-process run of the same global batch; a rank that disagrees is caught."""
    for wrap_first in (True, False):
        _ddp_run(rank, wrap_first)

    bad = {"0": torch.ones(4, 4, dtype=torch.bool), "2": torch.ones(3, dtype=torch.bool)}
    bad["2"][rank] = False  # same count of kept entries on both ranks, different positions
    with pytest.raises(RuntimeError, match=r"masks differ across ranks for layer\(s\) \['2'\]"):
        C.verify_masks(bad, S.comm())


def _ddp_run(rank: int, wrap_first: bool) -> None:
    """The Pruner gets the DDP wrapper (masks held by the pruner) or the module before it is
    wrapped (masks as parametrizations)."""
    ref_model = _mlp()
    sched = sk.Linear(start=0, end=4, every=2)
    if wrap_first:
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(ref_model))
        pruner = sk.Pruner(model, sparsity=0.5, scope="global", schedule=sched)
    else:
        inner = copy.deepcopy(ref_model)
        pruner = sk.Pruner(inner, sparsity=0.5, scope="global", schedule=sched)
        model = nn.parallel.DistributedDataParallel(inner)
    assert set(pruner.masks) == {"0", "2", "4"}
    # the store is picked once: held for the wrapper, parametrizations on the bare module
    assert isinstance(pruner._store, HeldMasks if wrap_first else ParametrizedMasks)
    assert (find_mask(pruner.model[0]) is None) == wrap_first
    ref_pruner = sk.Pruner(ref_model, sparsity=0.5, scope="global", schedule=sched)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        x, y = _batch(step)
        local = slice(rank * 4, rank * 4 + 4)
        loss = _train(model, pruner, opt, step, x[local], y[local])
        ref_loss = _train(ref_model, ref_pruner, ref_opt, step, x, y)
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / WORLD, ref_loss, rtol=1e-5, atol=1e-6)
        for name, mask in pruner.masks.items():
            a, b = _gather(mask)
            assert torch.equal(a, b), (step, name)
            assert torch.equal(mask, ref_pruner.masks[name]), (step, name)
    assert abs(pruner.report().global_sparsity - ref_pruner.report().global_sparsity) < 1e-9
    for name, module in pruner.modules.items():
        torch.testing.assert_close(module.weight, ref_pruner.modules[name].weight)


def check_wanda(rank: int, out_dir: str) -> None:
    """Each rank calibrates on its own batch; the norms are those of both batches together, and
    2:4 Wanda masks equal the single-process masks computed from all calibration data."""
    model = _mlp()
    g = torch.Generator().manual_seed(3)
    calib = [torch.randn(5, 16, generator=g) for _ in range(WORLD)]
    layers = {"0": model[0], "2": model[2]}
    ref_norms = collect_input_norms(model, layers, calib)
    norms = collect_input_norms(model, layers, [calib[rank]], comm=S.comm())
    for name in layers:
        torch.testing.assert_close(norms[name], ref_norms[name], rtol=1e-6, atol=1e-6)
    ref = {n: nm_mask(wanda(m.weight, ref_norms[n]), 2, 4) for n, m in layers.items()}
    pruner = sk.Pruner(
        model, pattern="2:4", criterion="wanda", calibration=[calib[rank]], include=["0", "2"]
    )
    pruner.step(0)
    for name in layers:
        assert torch.equal(pruner.masks[name], ref[name]), name

    # SparseGPT: Hessians averaged over the ranks' rows, same masks and weights as one process
    ref_model, model = _mlp(), _mlp()
    ref = sk.Pruner(ref_model, sparsity=0.5, criterion="sparsegpt", calibration=calib)
    ref.step(0)  # every rank solves the same problem: both ranks' batches
    pruner = sk.Pruner(model, sparsity=0.5, criterion="sparsegpt", calibration=[calib[rank]])
    pruner.step(0)
    for name, mask in pruner.masks.items():
        assert torch.equal(mask, ref.masks[name]), name
        torch.testing.assert_close(
            pruner.modules[name].weight, ref.modules[name].weight, rtol=1e-4, atol=1e-5
        )

    h, n = torch.full((1, 3, 3), float(rank + 1)), 2 + rank  # rank 0: 2 rows of H=1, rank 1: 3 of 2
    hh, nn_ = sparsegpt.reduce_hessian(h, n, S.comm())
    assert nn_ == 5
    torch.testing.assert_close(hh, torch.full((1, 3, 3), (2 * 1 + 3 * 2) / 5))


def check_fsdp2(rank: int, out_dir: str) -> None:
    """FSDP2 (fully_shard) on CPU: masks are local shards of DTensors, global magnitude
    thresholds found over the shards equal the single-process masks, training under a 2:4 ramp
    matches the one-process run, pruned weights stay zero, and the pruner state round-trips
    through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def sharded(m, root_only=False):
        for layer in () if root_only else (m[0], m[2], m[4]):
            fully_shard(layer)
        return fully_shard(m)

    calib = [torch.randn(6, 16, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    wanda_kw = dict(pattern="2:4", criterion="wanda", include=["0", "2"])
    for kwargs, sched, mine, ref_calib in (
        (dict(sparsity=0.6, scope="global"), sk.OneShot(0), None, None),
        (dict(sparsity=0.5), sk.OneShot(0), None, None),
        (wanda_kw, sk.Linear(0, 4, 2), [calib[rank]], calib),  # each rank its own batch
        (dict(pattern="2:4", scope="global", include=["0", "2"]), sk.Linear(0, 3, 1), None, None),
    ):
        ref_model = _mlp()
        # root only: a no-grad forward (calibration, evaluation) leaves the weights gathered
        model = sharded(copy.deepcopy(ref_model), root_only=mine is not None)
        pruner = sk.Pruner(model, schedule=sched, calibration=mine, **kwargs)
        assert isinstance(pruner._store, ShardedMasks)
        ref_pruner = sk.Pruner(ref_model, schedule=sched, calibration=ref_calib, **kwargs)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        pruner.step(0)
        ref_pruner.step(0)
        for step in range(1, 5):
            x, y = _batch(step)
            local = slice(rank * 4, rank * 4 + 4)
            loss = _train(model, pruner, opt, step, x[local], y[local])
            ref_loss = _train(ref_model, ref_pruner, ref_opt, step, x, y)
            with torch.no_grad():  # an evaluation between steps, as the CLI does
                model(x)
            dist.all_reduce(loss)
            torch.testing.assert_close(loss / WORLD, ref_loss, rtol=1e-4, atol=1e-5)
        report, ref_report = pruner.report(), ref_pruner.report()  # counts summed over shards
        assert report.to_dict() == ref_report.to_dict(), kwargs
        for name, mask in pruner.masks.items():
            assert S.is_sharded(mask)
            assert torch.equal(_full(mask), ref_pruner.masks[name]), (kwargs, name)
            weight = pruner.modules[name].weight
            assert not bool((S.local(weight)[~S.local(mask)] != 0).any())
            torch.testing.assert_close(
                weight.full_tensor(), ref_pruner.modules[name].weight, rtol=1e-4, atol=1e-5
            )

    ckpt = os.path.join(out_dir, "dcp")
    dcp.save({"pruner": pruner.state_dict()}, checkpoint_id=ckpt)
    fresh = sharded(_mlp(seed=1))
    other = sk.Pruner(fresh, schedule=sk.Linear(0, 3, 1), **kwargs)
    state = {"pruner": other.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    other.load_state_dict(state["pruner"])
    assert other.progress == pruner.progress and other.last_step == pruner.last_step
    for name, mask in pruner.masks.items():
        assert torch.equal(S.local(other.masks[name]), S.local(mask))
        assert not bool((S.local(other.modules[name].weight)[~S.local(mask)] != 0).any())
    # the full (unsharded) masks of a single-process state load into shards as well
    other.load_state_dict(ref_pruner.state_dict())
    for name, mask in pruner.masks.items():
        assert torch.equal(S.local(other.masks[name]), S.local(mask))


# ---- pytest entry points --------------------------------------------------------------------

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


@needs_gloo
def test_replicated_and_sharded_masks_on_two_gloo_ranks():
    """Every check above in one pair of spawned ranks (each spawn imports torch and sparsekit
    twice over: the checks share it)."""
    _spawn("check_all")


def check_static_scales(rank: int, out_dir: str) -> None:
    """quantize_ with a static scheme: each rank calibrates on its own batches, and every rank
    ends with the same scale, the largest input over all ranks' batches / qmax."""
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(nn.Linear(8, 4))
    g = torch.Generator().manual_seed(100 + rank)
    cal = [torch.randn(3, 8, generator=g) * (1 + 3 * rank) for _ in range(2)]
    sk.quantize_(model, "int8_static", calibration=cal)
    local_max = max(float(b.abs().max()) for b in cal)
    both = [torch.zeros(1, dtype=torch.float64) for _ in range(WORLD)]
    dist.all_gather(both, torch.tensor([local_max], dtype=torch.float64))
    want = torch.tensor([max(float(t) for t in both)], dtype=torch.float32) / 127
    torch.testing.assert_close(model[0].input_scale, want, rtol=0, atol=0)
    # QAT: each rank trains on its own batch, and the tracked range moves the same everywhere
    torch.manual_seed(0)
    qat = nn.Sequential(nn.Linear(8, 4))
    sk.prepare_qat_(qat, "fp8_static", calibration=cal)
    start = qat[0].qat_input_amax.clone()
    batch = torch.randn(3, 8, generator=g) * (1 + 5 * rank)
    qat.train()(batch)
    peak = torch.tensor([float(batch.abs().max())], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    want = start + 0.01 * (peak.float() - start)
    torch.testing.assert_close(qat[0].qat_input_amax, want)
    ranges = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_gather(ranges, qat[0].qat_input_amax.detach().clone())
    assert torch.equal(ranges[0], ranges[1])


def check_all(rank: int, out_dir: str) -> None:
    check_threshold(rank, out_dir)
    check_ddp(rank, out_dir)
    check_wanda(rank, out_dir)
    check_static_scales(rank, out_dir)
    check_fsdp2(rank, out_dir)


def test_single_process_helpers_are_identities():
    assert S.rank() == 0 and S.world_size() == 1 and D.is_main() and S.comm() is None
    model = nn.Linear(4, 4)
    assert S.unwrap(model) is model and S.local(model.weight) is model.weight
    C.verify_masks({"w": torch.ones(2, dtype=torch.bool)}, None)
    h = torch.eye(2)[None]
    assert sparsegpt.reduce_hessian(h, 3, None) == (h, 3)


def test_split_batch_and_init_errors():
    assert D.split_batch(12, 3) == 4
    with pytest.raises(ValueError, match="batch_size=10.*not divisible by the world size 4"):
        D.split_batch(10, 4)
    with pytest.raises(ValueError, match="backend 'mpi' is not allowed"):
        D.init(backend="mpi")
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        D.init(backend="nccl", device="cpu")


def test_distributed_mode_outside_torchrun():
    assert D.resolve_mode("auto") == "none" and D.resolve_mode("none") == "none"
    with pytest.raises(ValueError, match="train.distributed=ddp needs processes started by"):
        D.resolve_mode("ddp")
    with pytest.raises(ValueError, match="train.distributed='mpi' is not allowed"):
        D.resolve_mode("mpi")
    from sparsekit.run.config import Config, ConfigError, validate

    cfg = Config()
    cfg.train.distributed = "horovod"
    with pytest.raises(ConfigError, match="train.distributed"):
        validate(cfg)


def test_mask_checksum_sees_moved_entries():
    a = torch.tensor([True, False, False, True])
    b = torch.tensor([False, True, True, False])  # same count, same position sum
    assert C.mask_checksum(a) != C.mask_checksum(b)
    assert C.mask_checksum(a) == C.mask_checksum(a.clone())


# ---- the command line under torchrun --------------------------------------------------------

TINY_CLI = [
    "data.kwargs.num_samples=300", "train.dense_steps=30", "train.finetune_steps=20",
    "train.log_every=5", "train.eval_every=5", "train.checkpoint_every=5",
    "schedule.end=10", "schedule.every=5", "bench=off", "train.quiet=true",
    "train.device=cpu",  # gloo ranks, also on a GPU machine
]  # fmt: skip


def _torchrun(args: list[str], cwd, kill: tuple[str, int] | None = None) -> subprocess.Popen:
    """``torchrun --nproc_per_node=2 -m sparsekit ARGS``; ``kill=(phase, step)``: every rank
    SIGKILLed right after writing that checkpoint (tests/kill_after_checkpoint.py)."""
    from kill_after_checkpoint import command as kill_command

    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    entry = ["-m", "sparsekit"] if kill is None else kill_command(*kill)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "SPARSEKIT_QUIET": "1"}
    return subprocess.Popen([sys.executable, *launcher, *entry, *args], cwd=cwd, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The reference: the command line in one process, this one (also caches the dense
    model)."""
    from kill_after_checkpoint import run_here

    root = tmp_path_factory.mktemp("cli")
    run_here([*TINY_CLI, f"cache_dir={root / 'cache'}", "hydra.run.dir=single"], root)
    return root


@needs_gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.slow
def test_torchrun_cli_kill_resume_matches_one_process(one_process_run, mode, tmp_path):
    """torchrun, 2 gloo ranks, DDP or FSDP2: SIGKILLed mid fine-tuning, resumed; ends like a
    one-process run of the same global batches (masks equal, weights and loss within float
    tolerance), with one run directory, one TensorBoard writer and one checkpoint writer."""
    from safetensors.torch import load_file

    from sparsekit.run.pipeline import CHECKPOINT
    from sparsekit.io.runstate import load_checkpoint

    args = [*TINY_CLI, f"cache_dir={one_process_run / 'cache'}", f"train.distributed={mode}"]
    killed = _torchrun(args, tmp_path, kill=("finetune", 9))
    _, err = killed.communicate(timeout=300)
    assert killed.returncode != 0
    (run_dir,) = (tmp_path / "runs").iterdir()  # both ranks wrote into rank 0's directory
    assert not (run_dir / "summary.json").exists()
    assert load_checkpoint(run_dir / CHECKPOINT)["step"] == 9
    ckpt_dir = run_dir / CHECKPOINT.parent
    if mode == "ddp":  # replicated: one file (and the one before it), from rank 0
        assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.prev.pt", "last.pt"]
    else:  # sharded: each rank's shard, and rank 0's pointer to them
        assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.dcp", "last.pt"]
        assert len(list((ckpt_dir / "last.dcp").glob("*.distcp"))) == 2

    resumed = _torchrun(["resume=true"], tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert out.count("TensorBoard logdir") == 1  # the summary table comes from rank 0 only
    compressed = list((run_dir / "tb").glob("*/compressed/events.out.tfevents.*"))
    assert len(compressed) == 2  # killed + resumed, in the same TensorBoard run

    single = one_process_run / "single"
    a = json.loads((single / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    assert a["sparsity"] == b["sparsity"]
    assert abs(a["compressed"]["loss"] - b["compressed"]["loss"]) < 1e-4
    wa = load_file(single / "model.safetensors")
    wb = load_file(run_dir / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k] == 0, wb[k] == 0), k  # same masks
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


@needs_gloo
@pytest.mark.slow
def test_torchrun_cli_world_size_that_cannot_split_the_batch(tmp_path):
    proc = _torchrun(["data.batch_size=101", "train.quiet=true"], tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert (
        "sparsekit: error: data.batch_size=101 (the global batch) is not divisible by the "
        "world size 2" in err
    )
    assert "Traceback" not in err.split("sparsekit: error")[0]  # one line, not a traceback

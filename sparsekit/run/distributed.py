"""Running sparsekit under ``torchrun``: joining the process group, DDP / FSDP2 wrapping,
each rank's share of a batch, and sharded training state for resuming.

Everything here is a no-op, or the identity, in a single process (no process group, or a world
of one). How the ranks' masks agree: :mod:`sparsekit.nn.shards`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from sparsekit.nn.shards import is_distributed, is_initialized, rank, world_size
from sparsekit.names import DISTRIBUTED_MODES as MODES

BACKENDS = ("auto", "gloo", "nccl")
# NVLink SHARP / multicast off: on the shared H200 hosts this project is measured on, a
# communicator using it could hang the GPU (docs/distributed.md). Set by the command line under
# torchrun (set_launch_env), never by library calls; export other values to override.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def is_main() -> bool:
    """True on the rank that writes files, logs and checkpoints (rank 0)."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed():
        dist.barrier()


T = TypeVar("T")


def from_rank0(compute: Callable[[], T], exit_code: int = 1) -> T:
    """``compute()`` run on rank 0 only, its (picklable) result given to every rank; just
    ``compute()`` in a single process. When it raises on rank 0, the other ranks leave with
    ``SystemExit`` (the code of rank 0's SystemExit, else ``exit_code``) instead of waiting,
    and rank 0 raises the original. For decisions every rank must share and only one may
    make: a run directory, which run to resume.

    >>> from_rank0(lambda: "runs/a")  # a single process: rank 0, nobody to tell
    'runs/a'
    """
    box: list = [None]
    error: BaseException | None = None
    if is_main():
        try:
            box = [("value", compute())]
        except SystemExit as e:
            box, error = [("exit", e.code)], e
        except Exception as e:  # noqa: BLE001  (re-raised below, once the others know)
            box, error = [("exit", exit_code)], e
    if is_distributed():
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "exit":
        raise SystemExit(value)
    return value


def launched_by_torchrun() -> bool:
    """True when torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) is set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def set_launch_env() -> None:
    """Under torchrun (``WORLD_SIZE`` set), default :data:`NO_MULTICAST_ENV` in this process
    before any NCCL communicator exists; variables already set are kept. Called by the
    ``sparsekit`` command line only: library calls never change the process environment (a
    program that calls :func:`init` itself exports what it wants)."""
    if "WORLD_SIZE" in os.environ:
        for key, value in NO_MULTICAST_ENV.items():
            os.environ.setdefault(key, value)


def init(backend: str = "auto", device: str = "auto") -> torch.device:
    """Join the process group described by torchrun's environment variables (a no-op when not
    launched by torchrun or already initialized) and return this rank's device.

    ``backend``: ``"gloo"`` (CPU), ``"nccl"`` (CUDA), or ``"auto"`` (gloo on CPU, NCCL on CUDA).
    With NCCL the group also gets gloo for CPU tensors. ``device``: ``"cpu"``, ``"cuda"`` or
    ``"auto"``; on CUDA each rank takes GPU ``LOCAL_RANK``. Raises ValueError for an unknown or
    unavailable backend, NCCL without CUDA, or more ranks on a node than it has GPUs.
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"distributed backend {backend!r} is not allowed; choose one of: {BACKENDS}"
        )
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device {device!r} is not allowed; choose one of auto, cpu, cuda")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu' (gloo)")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ValueError("backend 'nccl' needs CUDA devices; use backend='gloo' on CPU")
    if not launched_by_torchrun() and not is_initialized():
        return torch.device("cuda" if use_cuda else "cpu")
    available = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
    }
    if not available[backend]:
        others = [b for b, ok in available.items() if ok] or ["none"]
        raise ValueError(
            f"distributed backend {backend!r} is not available in this torch build "
            f"(available: {', '.join(others)})"
        )
    if backend == "nccl" and available["gloo"]:
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors (counts, objects) still have a path
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cpu")
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA device(s): start "
                "at most one process per GPU (torchrun --nproc_per_node)"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not is_initialized():
        dist.init_process_group(backend, device_id=dev if use_cuda else None)
    return dev


def resolve_mode(setting: str) -> str:
    """``train.distributed`` -> ``"none"``, ``"ddp"`` or ``"fsdp2"``. ``auto``: DDP when launched
    by torchrun, else none. ``ddp``/``fsdp2`` outside torchrun: ValueError."""
    if setting not in MODES:
        raise ValueError(f"train.distributed={setting!r} is not allowed; choose one of: {MODES}")
    launched = launched_by_torchrun() or is_initialized()
    if setting == "auto":
        return "ddp" if launched else "none"
    if setting != "none" and not launched:
        raise ValueError(
            f"train.distributed={setting} needs processes started by torchrun "
            "(torchrun --nproc_per_node=N -m sparsekit ...); use auto or none otherwise"
        )
    return setting


def rank_slice(batch_indices: torch.Tensor) -> torch.Tensor:
    """This rank's equal share of a global batch's indices (rows ``[r*b, (r+1)*b)``); the whole
    batch in a single process. ValueError when the world cannot split the batch."""
    per = split_batch(len(batch_indices), what="data.batch_size")
    return batch_indices[rank() * per : (rank() + 1) * per]


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks (the value itself in a single process)."""
    if not is_distributed():
        return value
    out = value.detach().clone()
    dist.all_reduce(out)
    return out / world_size()


def shutdown() -> None:
    """Leave the process group, if any."""
    if is_initialized():
        dist.destroy_process_group()


def split_batch(global_batch: int, world: int | None = None, what: str = "batch_size") -> int:
    """Per-rank share of a global batch; ValueError when ``world`` ranks cannot split it evenly
    (uneven shares would change the loss that a one-process run of the same batch gives).

    >>> split_batch(64, 4)
    16
    """
    world = world_size() if world is None else world
    if global_batch % world:
        raise ValueError(
            f"{what}={global_batch} (the global batch) is not divisible by the world size "
            f"{world}; use a multiple of {world} or another --nproc_per_node"
        )
    return global_batch // world


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """``DistributedDataParallel`` that does not re-send buffers at every forward (pruning
    masks are buffers; the Pruner checks they agree at each update). Sync at construction still
    makes every rank start from rank 0's parameters and buffers."""
    import inspect

    ddp = nn.parallel.DistributedDataParallel
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(ddp).parameters
        else {"broadcast_buffers": False}
    )
    return ddp(model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)


def save_sharded(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``state`` (model/optimizer state dicts from
    ``torch.distributed.checkpoint.state_dict.get_state_dict``, ``Pruner.state_dict()``, plain
    numbers) with torch.distributed.checkpoint: every rank writes its own shards. Collective.
    Atomic: written to ``<path>.tmp`` and renamed onto ``path`` by rank 0 once every rank is
    done, so a kill leaves the previous checkpoint intact."""
    import shutil

    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    tmp, old = path + ".tmp", path + ".old"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    dcp.save(state, checkpoint_id=tmp)
    barrier()
    if is_main():
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def check_sharded_metadata(path: str | os.PathLike) -> Any:
    """The ``.metadata`` index of the sharded checkpoint ``path``, unpickled admitting only the
    plain data classes of :data:`sparsekit.io.pickles.PLAIN_CLASSES` (DCP's own unpickling
    has no restriction): :class:`~sparsekit.errors.UnsafeFileError` names any other class (and
    nothing in it runs); an unreadable one raises FileFormatError."""
    from sparsekit.io.pickles import restricted_load

    meta = os.path.join(os.fspath(path), ".metadata")
    with open(meta, "rb") as f:
        return restricted_load(f, meta)


def _safe_reader(path: str) -> Any:
    """DCP's file system reader whose ``.metadata`` is read by :func:`check_sharded_metadata`
    (the restricted unpickler) instead of ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = check_sharded_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_planner(path: str) -> Any:
    """DCP's default load planner, reading non-tensor items with ``weights_only=True`` (its
    own reads them with ``weights_only=False``, which runs any pickled code)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from sparsekit.io.files import safe_torch_load
    from sparsekit.errors import FileFormatError

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = safe_torch_load(value)
            except FileFormatError as e:
                raise type(e)(str(e).replace(repr(value), f"{path} (item {fqn!r})")) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner()


def load_sharded(state: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """Fill ``state`` (built like the one given to :func:`save_sharded`, from freshly built
    objects on the same world size) in place from ``path``; returns it. Collective. Nothing
    pickled in the files is run (:func:`check_sharded_metadata`, weights-only items)."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(path):
        raise FileNotFoundError(f"no sharded checkpoint at {path}")
    from sparsekit.errors import FileFormatError

    check_sharded_metadata(path)  # refused before DCP opens anything
    try:
        dcp.load(state, storage_reader=_safe_reader(os.fspath(path)),
                 planner=_safe_planner(os.fspath(path)))
    except dcp.api.CheckpointException as e:  # DCP gathers each rank's error into one
        for err, _ in getattr(e, "failures", {}).values():
            if isinstance(err, FileFormatError):
                raise err from None
        raise
    return state


def save_training_state(
    path: str | os.PathLike, model: nn.Module, optimizer: Any, pruner: Any = None, **extra: Any
) -> None:
    """Sharded (FSDP2) model, optimizer and pruner state, and the plain numbers in ``extra``
    (a step, say), through :func:`save_sharded`. Collective."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    pstate = {} if pruner is None else pruner.state_dict()
    save_sharded({"model": msd, "optim": osd, "pruner": pstate, **extra}, path)


def load_training_state(
    path: str | os.PathLike, model: nn.Module, optimizer: Any, pruner: Any = None, **extra: Any
) -> dict[str, Any]:
    """Restore what :func:`save_training_state` wrote into freshly built objects (same world
    size; the pruner created after ``fully_shard``). ``extra`` gives the keys and placeholder
    values of the plain numbers to read back; returns the loaded state. Collective."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    pstate = {} if pruner is None else pruner.state_dict()
    state = load_sharded({"model": msd, "optim": osd, "pruner": pstate, **extra}, path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if pruner is not None:
        pruner.load_state_dict(state["pruner"])  # after the weights: it zeroes pruned entries
    return state


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 over a whole model: rank 0's parameters and buffers are broadcast first (so every
    shard comes from the same model, whatever each rank computed before), then ``fully_shard``
    on the root. Create the Pruner afterwards. Returns ``model``, sharded in place."""
    from torch.distributed.fsdp import fully_shard

    if is_distributed():
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
    # the mesh on the model's own device type: left to itself, fully_shard builds a CUDA mesh
    # whenever CUDA is visible, even for a CPU (gloo) run
    from torch.distributed.device_mesh import init_device_mesh

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world_size(),)) if is_initialized() else None
    fully_shard(model, mesh=mesh)
    return model


def gather_full(sharded: nn.Module, into: nn.Module) -> nn.Module:
    """Load the full weights of an FSDP2 model into ``into`` (an unsharded module of the same
    structure, e.g. a copy taken before sharding) on every rank; returns ``into``. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    into.load_state_dict(full)
    return into

"""2:4 fine-tuning of a LLaMA-style decoder under DDP and FSDP2 on N GPUs, then accelerated.

    python tools/multigpu_run.py --out runs/multigpu                 # every visible GPU, ~1B model
    python tools/multigpu_run.py --gpus 1 --size small --out DIR     # one GPU, smaller model
    python tools/multigpu_run.py --smoke --out DIR                   # CPU, gloo, 2 processes (CI)

The model is a Hugging Face ``LlamaForCausalLM`` built from a config (``--size 1b``: 16 layers,
hidden 2048, MLP 8192, GQA 32/8 heads, byte vocabulary: 0.97B parameters), trained on the text
recipe's corpus (Python standard library source, bytes) under ``sk.Pruner(pattern="2:4")``
with a linear ramp over the first half of the steps. Every phase is a ``torchrun`` launch of
this file (``--worker``); NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set in every process.

1. throughput: world 1 and world N (per-GPU micro batch fixed), DDP (bf16 autocast) and FSDP2
   (``fully_shard`` per decoder layer, bf16 params, fp32 reduction): tokens/s after the ramp,
   scaling efficiency ``tokens/s(N) / (N * tokens/s(1))``; masks: DDP's are checked by an
   all-reduced checksum at every update, FSDP2's are shards (global checksum, N:M validity).
2. kill and resume (``--resume-size``, world N): an uninterrupted reference, then per mode a
   run whose rank 0 SIGKILLs itself mid fine-tuning and a resumed run from its last checkpoint
   (DDP: one file from rank 0; FSDP2: torch.distributed.checkpoint shards); losses after the
   resume and the final masks are compared with the reference.
3. accelerate: the world-1 DDP model, finalized, through ``sk.accelerate`` (bf16 2:4 and fp8
   2:4), timed against bf16 dense under CUDA graphs (its report's ``model_us``).

``--smoke``: CPU, gloo, world 2, a tiny model, 8 steps: DDP uninterrupted and FSDP2 killed then
resumed in two launches; FSDP2's losses and masks must match DDP's (fp32 on CPU).
Writes ``<out>/multigpu.json``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.nn import shards as S
from sparsekit.prune import checksums as C
from sparsekit.run import distributed as D
from sparsekit.io.files import atomic_torch_save, atomic_write, safe_torch_load

os.environ.update(D.NO_MULTICAST_ENV)  # before any NCCL communicator exists, in every process

SIZES = {  # hidden, MLP, layers, heads, kv heads
    "tiny": (64, 128, 2, 4, 2),
    "small": (1024, 4096, 4, 16, 8),
    "1b": (2048, 8192, 16, 32, 8),
}
MODES = ("ddp", "fsdp2")


def build_model(size: str, device: torch.device, seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, mlp, layers, heads, kv = SIZES[size]
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(config)


class Logits(nn.Module):
    """``input_ids -> logits`` (no KV cache, plain tensor out: what CUDA graphs can capture)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def batch(data, step: int, micro: int, seed: int, device: torch.device):
    """This rank's slice of the global batch of ``step`` (a pure function of seed and step, so
    a resumed run sees the batches the killed one would have)."""
    world, rank = S.world_size(), S.rank()
    idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed * 100003 + step))
    mine = idx[: micro * world][rank * micro : (rank + 1) * micro]
    x, y = zip(*(data[int(i)] for i in mine))
    return torch.stack(x).to(device), torch.stack(y).to(device)


def _total(pruner: sk.Pruner, local_count: int) -> int:
    """A count over the whole masks: summed over ranks when they hold shards."""
    sharded = any(S.is_sharded(m) for m in pruner.masks.values())
    if not sharded or S.comm() is None:
        return local_count
    return int(S.comm().all_reduce_sum(torch.tensor([local_count]))[0])


def nm_violations(pruner: sk.Pruner) -> int:
    """Groups of 4 consecutive inputs holding more than 2 kept weights (rows are whole on every
    rank, and every pruned layer's input dimension is a multiple of 4)."""
    masks = pruner.masks.values()
    return _total(pruner, sum(int((S.local(m).reshape(-1, 4).sum(-1) > 2).sum()) for m in masks))


def kept_fraction(pruner: sk.Pruner) -> float:
    kept = _total(pruner, sum(int(S.local(m).sum()) for m in pruner.masks.values()))
    return kept / sum(m.numel() for m in pruner.masks.values())


def mask_checksum(pruner: sk.Pruner) -> int:
    """Sum of every layer's whole-mask checksum (equal for equal masks, however sharded)."""
    return sum(C.global_mask_checksum(m) for m in pruner.masks.values()) % (1 << 62)


def save(mode, path, step, model, opt, pruner) -> None:
    if mode == "fsdp2":  # every rank writes its shards (torch.distributed.checkpoint)
        D.save_training_state(path, model, opt, pruner, step=step)
        return
    D.barrier()
    if D.is_main():  # replicated state: one file, from rank 0 only
        state = {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "pruner": pruner.state_dict(),
            "step": step,
        }
        atomic_torch_save(state, path)
    D.barrier()


def load(mode, path, device, model, opt, pruner) -> int:
    """Restore a checkpoint written by :func:`save`; returns the next step."""
    if mode == "fsdp2":
        return int(D.load_training_state(path, model, opt, pruner, step=-1)["step"]) + 1
    state = safe_torch_load(path, map_location=device)
    pruner.load_state_dict(state["pruner"])  # first: it creates the parametrized keys
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return int(state["step"]) + 1


def run_mode(a, mode: str, device: torch.device, data) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda"
    rundir = Path(a.out) / a.tag / mode
    rundir.mkdir(parents=True, exist_ok=True)
    ckpt = rundir / ("ckpt" if mode == "fsdp2" else "ckpt.pt")
    ramp_end = a.steps // 2
    schedule = sk.Linear(start=0, end=ramp_end, every=max(1, ramp_end // 4))
    prune_kw = dict(pattern="2:4", include=["model.layers.*"], schedule=schedule)

    model = build_model(a.size, device, a.seed)
    params = sum(p.numel() for p in model.parameters())
    if mode == "ddp":
        pruner = sk.Pruner(model, **prune_kw)  # before wrapping: masks as parametrizations
        wrapped = D.wrap_ddp(model, device)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # on CPU name the mesh: left to itself fully_shard builds a CUDA one if CUDA is visible
        kw = {"mp_policy": mp} if cuda else {"mesh": init_device_mesh("cpu", (S.world_size(),))}
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        wrapped = fully_shard(model, **kw)
        pruner = sk.Pruner(model, **prune_kw)  # after sharding: masks sharded like the weights
    opt = torch.optim.AdamW(wrapped.parameters(), lr=a.lr, weight_decay=0.0)
    start = 0
    if a.resume and ckpt.exists():
        start = load(mode, ckpt, device, model, opt, pruner)
    kill = a.kill_step if a.kill_mode == mode else None

    losses: dict[int, torch.Tensor] = {}
    logged: list[int] = []

    def flush() -> None:  # losses so far, appended by rank 0 (a kill keeps what was flushed)
        if D.is_main():
            with open(rundir / "losses.jsonl", "a") as f:
                for s in sorted(set(losses) - set(logged)):
                    f.write(json.dumps({"step": s, "loss": losses[s].item()}) + "\n")
                    logged.append(s)

    timed_from = max(start + a.warmup, ramp_end + 1)
    t0 = None
    updates = 0
    for step in range(start, a.steps):
        if step == timed_from:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        x, y = batch(data, step, a.micro, a.seed, device)
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda and mode == "ddp"):
            logits = wrapped(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        updates += pruner.step(step)  # DDP: raises if any rank's masks differ
        mean = loss.detach().clone()
        if S.is_distributed():
            dist.all_reduce(mean)
        losses[step] = mean / S.world_size()
        if step == kill:
            flush()
            if D.is_main():
                os.kill(os.getpid(), signal.SIGKILL)  # torchrun then stops the other ranks
        if a.ckpt_every and (step + 1) % a.ckpt_every == 0:
            save(mode, ckpt, step, model, opt, pruner)
            flush()
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0 if t0 is not None else None
    flush()
    steps_timed = a.steps - timed_from
    tokens = steps_timed * a.micro * S.world_size() * a.seq
    result = {
        "mode": mode,
        "world": S.world_size(),
        "size": a.size,
        "parameters": params,
        "pruned_layers": len(pruner.masks),
        "steps": a.steps,
        "resumed_from": start if start else None,
        "global_batch": a.micro * S.world_size(),
        "seq_len": a.seq,
        "mask_updates_this_launch": updates,
        "final_loss": losses[a.steps - 1].item() if a.steps - 1 in losses else None,
        "tokens_per_s": tokens / elapsed if elapsed else None,
        "timed_steps": steps_timed,
        "mask_checksum": mask_checksum(pruner),
        "kept_fraction": kept_fraction(pruner),
        "nm_violations": nm_violations(pruner),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }
    if mode == "ddp":
        # every update was already checked by the pruner; state it once more at the end
        sums = [0] * S.world_size()
        if S.is_distributed():
            dist.all_gather_object(sums, result["mask_checksum"])
        else:
            sums = [result["mask_checksum"]]
        result["masks_identical_across_ranks"] = len(set(sums)) == 1
    else:
        result["masks_identical_across_ranks"] = None  # shards: see nm_violations, checksum
    result["accelerate"] = None

    def write() -> None:  # before accelerating too: a timeout there keeps the training figures
        if D.is_main():
            text = json.dumps(result, indent=1)
            atomic_write(rundir / "result.json", lambda tmp: Path(tmp).write_text(text))

    write()
    if a.accelerate and mode == "ddp" and cuda and S.world_size() == 1:
        del opt
        result["accelerate"] = accelerate(pruner, model, data, device, a)
        write()
    return result


def accelerate(pruner, model, data, device, a) -> dict:
    """bf16 2:4 and fp8 2:4 of the finalized model vs bf16 dense, all under CUDA graphs."""
    pruner.finalize()
    x, _ = batch(data, 0, a.infer_batch, a.seed + 1, device)
    out = {"input_shape": list(x.shape)}
    base = Logits(model).eval()
    for precision in ("bf16", "fp8"):
        net = copy.deepcopy(base)
        t = time.perf_counter()
        try:
            fast = sk.accelerate(net, x, precision=precision, sparsity="2:4")
        except Exception as e:  # a measurement script: record why, keep the other results
            out[precision + "_2:4"] = {"error": repr(e)[:800]}
            continue
        report = fast.sparsekit_report
        with torch.no_grad():
            ref = base.to(torch.bfloat16)(x).float()
            err = (fast(x).float() - ref).norm() / ref.norm()
        out[precision + "_2:4"] = {
            "model_us": report.model_us,
            "speedup_vs_bf16_dense": report.model_speedup,
            "layers_sparse": sum(1 for d in report.layers if "2:4" in str(d.variant)),
            "layers": len(report.layers),
            "rel_error_vs_bf16_dense": float(err),
            "plan_seconds": time.perf_counter() - t,
        }
        del fast, net
        torch.cuda.empty_cache()
    return out


def worker(a) -> None:
    from sparsekit.data.text import stdlib_text

    device = D.init(backend="auto", device="cpu" if a.cpu else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    data = stdlib_text(Path(a.out) / "cache", seq_len=a.seq, max_bytes=a.max_bytes).train
    for mode in a.modes:
        run_mode(a, mode, device, data)
        gc.collect()  # FSDP's hooks hold reference cycles to the last mode's modules
        if device.type == "cuda":  # the next mode starts from an empty GPU
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    D.barrier()
    D.shutdown()


# ---- driver ---------------------------------------------------------------------------------


def launch(a, world: int, tag: str, modes, size: str, steps: int, extra=(), ckpt=True) -> int:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={world}", __file__, "--worker", "--out", a.out, "--tag", tag,
        "--modes", *modes, "--size", size, "--steps", str(steps), "--micro", str(a.micro),
        "--seq", str(a.seq), "--lr", str(a.lr), "--seed", str(a.seed),
        "--warmup", str(a.warmup), "--ckpt-every", str(a.ckpt_every if ckpt else 0),
        "--infer-batch", str(a.infer_batch), "--max-bytes", str(a.max_bytes), *extra,
    ]  # fmt: skip
    if a.cpu:
        cmd.append("--cpu")
    env = {**os.environ, **D.NO_MULTICAST_ENV, "PYTHONUNBUFFERED": "1"}
    print("+", " ".join(cmd[3:]), flush=True)
    return subprocess.run(cmd, env=env).returncode


def read_losses(out: str, tag: str, mode: str) -> dict[int, float]:
    path = Path(out) / tag / mode / "losses.jsonl"
    if not path.exists():  # the launch died before its first checkpoint
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a resumed step overwrites the killed run's


def read_result(out: str, tag: str, mode: str) -> dict:
    path = Path(out) / tag / mode / "result.json"
    return json.loads(path.read_text()) if path.exists() else {}


def fresh(out: str, tag: str) -> str:
    """Remove what an earlier invocation left under ``tag`` (checkpoints, loss logs)."""
    shutil.rmtree(Path(out) / tag, ignore_errors=True)
    return tag


def compare(ref: dict[int, float], got: dict[int, float], from_step: int) -> float:
    steps = [s for s in ref if s >= from_step]
    if not steps or any(s not in got for s in steps):
        return math.inf
    return max(abs(ref[s] - got[s]) for s in steps)


def kill_and_resume(a, world: int, tag: str, ref_tag: str, size: str, steps: int) -> dict:
    """Per mode: a launch whose rank 0 dies by SIGKILL at ``kill``, then a resumed launch; the
    losses from the resume point on and the final masks are compared with ``ref_tag``'s."""
    kill = steps - 2 - (steps - 2) % a.ckpt_every + 1  # one step past a checkpoint
    out = {"kill_after_step": kill}
    fresh(a.out, tag)
    for mode in MODES:
        rc = launch(a, world, tag, [mode], size, steps, ["--kill", mode, str(kill)])
        killed_losses = read_losses(a.out, tag, mode)
        rc2 = launch(a, world, tag, [mode], size, steps, ["--resume"])
        res = read_result(a.out, tag, mode) if rc2 == 0 else {}
        ref = read_result(a.out, ref_tag, mode)
        resumed = res.get("resumed_from")
        ref_losses, after = read_losses(a.out, ref_tag, mode), read_losses(a.out, tag, mode)
        before = {s: v for s, v in killed_losses.items() if resumed is None or s < resumed}
        # steps the killed run took past its checkpoint, taken again by the resumed run: on a
        # GPU whose kernels are not bitwise reproducible from launch to launch, this is the
        # exact test of the resume; the uninterrupted run differs by that noise from step 1
        replayed = {s: killed_losses[s] for s in killed_losses if resumed is not None
                    and s >= resumed}  # fmt: skip
        out[mode] = {
            "killed_run_exit_code": rc,
            "killed_run_last_logged_step": max(killed_losses) if killed_losses else None,
            "resumed_run_exit_code": rc2,
            "resumed_from_step": resumed,
            "max_abs_loss_diff_replayed_steps_vs_killed_run": compare(replayed, after, 0),
            "max_abs_loss_diff_before_kill_vs_uninterrupted": compare(before, ref_losses, 0),
            "max_abs_loss_diff_vs_uninterrupted": compare(ref_losses, after, resumed or 0),
            "final_masks_equal_uninterrupted": bool(res)
            and res.get("mask_checksum") == ref.get("mask_checksum"),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/multigpu")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 processes, tiny model")
    p.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU)")
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--resume-size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--resume-steps", type=int, default=12)
    p.add_argument("--micro", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=1024, help="bytes per sequence")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--infer-batch", type=int, default=4)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU processes (--gpus: how many)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="run", help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--kill", nargs=2, metavar=("MODE", "STEP"), help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--accelerate", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.kill_mode, a.kill_step = (a.kill[0], int(a.kill[1])) if a.kill else (None, None)
    if a.worker:
        worker(a)
        return
    Path(a.out).mkdir(parents=True, exist_ok=True)
    started = time.time()
    if a.smoke:
        a.cpu, a.size, a.steps, a.micro, a.seq, a.ckpt_every = True, "tiny", 8, 2, 32, 2
        a.lr, a.max_bytes, a.warmup = 1e-3, 200_000, 1
        result = smoke(a)
    else:
        result = full(a)
    result.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() and not a.cpu else "cpu",
        torch=torch.__version__,
        wall_s=round(time.time() - started, 1),
        env={k: os.environ.get(k) for k in D.NO_MULTICAST_ENV},
    )
    text = json.dumps(result, indent=1, default=str)
    atomic_write(Path(a.out) / "multigpu.json", lambda tmp: Path(tmp).write_text(text))
    print(text)


def smoke(a) -> dict:
    """Launch 1: DDP uninterrupted, then FSDP2 killed mid-run; launch 2: FSDP2 resumed."""
    kill = 5  # checkpoints after steps 1 and 3 (ckpt_every 2): resume at 4
    tag = fresh(a.out, "smoke")
    rc = launch(a, 2, tag, list(MODES), a.size, a.steps, ["--kill", "fsdp2", str(kill)])
    rc2 = launch(a, 2, tag, ["fsdp2"], a.size, a.steps, ["--resume"])
    ddp = read_result(a.out, tag, "ddp")
    fsdp2 = read_result(a.out, tag, "fsdp2") if rc2 == 0 else {}
    diff = compare(read_losses(a.out, "smoke", "ddp"), read_losses(a.out, "smoke", "fsdp2"), 0)
    return {
        "smoke": True,
        "killed_run_exit_code": rc,
        "resumed_run_exit_code": rc2,
        "ddp": ddp,
        "fsdp2": fsdp2,
        "fsdp2_resumed_from": fsdp2.get("resumed_from"),
        "max_abs_loss_diff_fsdp2_vs_ddp": diff,
        "fsdp2_masks_equal_ddp": fsdp2.get("mask_checksum") == ddp.get("mask_checksum"),
    }


def full(a) -> dict:
    n = a.gpus or (2 if a.cpu else torch.cuda.device_count())
    if n < 1:
        raise SystemExit("no CUDA device: use --smoke (or --cpu) for a CPU run")
    out: dict = {"gpus": n}
    if launch(a, n, fresh(a.out, "ref"), list(MODES), a.resume_size, a.resume_steps) == 0:
        out["kill_resume"] = kill_and_resume(a, n, "kr", "ref", a.resume_size, a.resume_steps)
    # throughput runs write no checkpoints (a 1B model's AdamW state is 12 GB a save); DDP last:
    # its finalized model is then accelerated
    modes = ["fsdp2", "ddp"]
    launch(a, 1, fresh(a.out, "w1"), modes, a.size, a.steps, ["--accelerate"], ckpt=False)
    one = {m: read_result(a.out, "w1", m) for m in MODES}
    out["world1"] = one
    if n > 1:
        launch(a, n, fresh(a.out, f"w{n}"), modes, a.size, a.steps, ckpt=False)
        many = {m: read_result(a.out, f"w{n}", m) for m in MODES}
        out[f"world{n}"] = many
        out["scaling_efficiency"] = {
            m: many[m]["tokens_per_s"] / (n * one[m]["tokens_per_s"])
            for m in MODES if many[m].get("tokens_per_s") and one[m].get("tokens_per_s")
        }  # fmt: skip
    else:
        out["scaling_efficiency"] = "not measured: one GPU"
    return out


if __name__ == "__main__":
    main()

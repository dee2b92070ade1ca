"""tools/multigpu_run.py --smoke: torchrun, gloo, 2 CPU processes, DDP and FSDP2 (killed by
SIGKILL mid fine-tuning, then resumed from its torch.distributed.checkpoint shards)."""

import json

import pytest
import torch.distributed as dist


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.slow
def test_smoke_ddp_and_fsdp2_kill_resume(tmp_path, tool_module, monkeypatch):
    from sparsekit.run.distributed import NO_MULTICAST_ENV

    # the driver in this process (its launches are torchrun processes, as from its command
    # line); importing it sets these for every process it starts: put back after the test
    for key, value in NO_MULTICAST_ENV.items():
        monkeypatch.setenv(key, value)
    tool_module("multigpu_run").main(["--smoke", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "multigpu.json").read_text())
    assert r["killed_run_exit_code"] != 0 and r["resumed_run_exit_code"] == 0
    assert r["fsdp2_resumed_from"] == 4  # killed after step 5, last checkpoint after step 3
    ddp, fsdp2 = r["ddp"], r["fsdp2"]
    assert ddp["masks_identical_across_ranks"] is True
    for run in (ddp, fsdp2):
        assert run["world"] == 2 and run["pruned_layers"] == 14  # 7 linears x 2 decoder layers
        assert run["kept_fraction"] == 0.5 and run["nm_violations"] == 0
    # FSDP2 (sharded masks, killed and resumed) follows DDP's trajectory: fp32 on CPU
    assert r["max_abs_loss_diff_fsdp2_vs_ddp"] < 1e-4
    assert r["fsdp2_masks_equal_ddp"] is True
    losses = [json.loads(x)["loss"] for x in (tmp_path / "smoke/ddp/losses.jsonl").open()]
    assert losses[-1] < losses[0]
    # replicated DDP state: one file from rank 0; FSDP2: a directory of per-rank shards
    assert (tmp_path / "smoke/ddp/ckpt.pt").is_file()
    assert len(list((tmp_path / "smoke/fsdp2/ckpt").glob("*.distcp"))) == 2

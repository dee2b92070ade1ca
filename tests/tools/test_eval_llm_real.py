import json

import pytest


def test_smoke_runs_every_kind_of_stage_and_resumes(tmp_path, tool_module):
    """On a tiny random Llama: dense, one shot with block reconstruction calibrated on a mix
    of text and teacher samples, distillation and GPTQ int4 land in the JSON with ratios to
    dense on every held-out domain; a second run reuses the saved one-shot and distilled
    weights (same figures) instead of redoing them."""
    pytest.importorskip("transformers")
    tool = tool_module("eval_llm_real")
    out, state = tmp_path / "real.json", tmp_path / "state"
    stages = "dense,sparsegpt+recon@mix>distill@mix>gptq4"
    args = ["--smoke", "--out", str(out), "--state-dir", str(state), "--stages", stages,
            "--device", "cpu"]
    tool.main(args)
    r = json.loads(out.read_text())
    dense, row = r["stages"]["dense"], r["stages"]["sparsegpt+recon@mix>distill@mix>gptq4"]
    assert set(dense["perplexity"]) == {"man", "info", "code-heldout"}
    for domain, ppl in row["perplexity"].items():
        assert row["ratio"][domain] == pytest.approx(ppl / dense["perplexity"][domain], 1e-3)
    steps = [d["step"] for d in row["detail"]]
    assert steps == ["sparsegpt+recon", "distill", "gptq4"]
    assert row["detail"][0]["reconstruct"]["reconstruct_steps"] == 5
    assert row["detail"][1]["steps_done"] == 6 and row["detail"][1]["tokens"] > 0
    again = tool.main(args)["stages"]["sparsegpt+recon@mix>distill@mix>gptq4"]
    assert [d.get("reused") is not None for d in again["detail"]] == [True, True, False]
    assert again["perplexity"] == pytest.approx(row["perplexity"], rel=1e-4)


def test_device_script_is_valid_bash_and_names_the_tool():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "tools" / "device_llm_accuracy.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "tools/eval_llm_real.py" in text and "sha256sum -c" in text

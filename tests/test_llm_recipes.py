"""The LLM recipes on the command line with a tiny Llama and a tiny BERT: perplexity before and
after, <run>/hf/ loading with from_pretrained to the same logits, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import sparsekit as sk
from sparsekit.quant.compressed_tensors import ct_available as compressed_tensors_available
from sparsekit.nn.select import select_modules
from test_cli import run_cli

transformers = pytest.importorskip("transformers")

HEAD = "re:lm_head|cls.predictions.decoder"
TINY = ["data.seq_len=32", "prune.calibration_batches=2", "data.eval_batches=2",
        "data.batch_size=4", "train.finetune_steps=3", "train.quiet=true", "tracker=none"]


@pytest.mark.parametrize("model", ["llama", "bert"])
@pytest.mark.parametrize("recipe", ["llm_sparsegpt_24", "llm_sparsegpt_24_fp8",
                                    "llm_wanda_24_distill", "llm_sparsegpt_24_fp8_static",
                                    "llm_sparsegpt_24_fp8_static_tensor",
                                    "llm_sparsegpt_24_fp8w"])
def test_llm_recipe(recipe, model, hf_dirs, tmp_path, capsys):
    code, out, err = run_cli([f"recipe={recipe}", f"model.path={hf_dirs[model]}",
                              f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}",
                              *TINY], tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["metric"] == "perplexity" and s["sparsity"] == 0.5
    for key in ("dense", "compressed"):  # random tiny models: about the vocabulary size
        assert 30 < s[key]["perplexity"] < 3000
    assert s["finetune_steps"] == (3 if "distill" in recipe else 0)
    ct = s["hf"]["compressed_tensors"]
    if "fp8" in recipe and compressed_tensors_available():
        # fp8, fp8_static, fp8_static_tensor (W8A8: float-quantized) or fp8_weight_only (the
        # format compressed-tensors infers for W8A16 fp8: naive-quantized)
        scheme = recipe.removeprefix("llm_sparsegpt_24_").replace("fp8w", "fp8_weight_only")
        fmt = "naive-quantized" if scheme == "fp8_weight_only" else "float-quantized"
        assert ct.startswith(f"written: {fmt} ({scheme}, ") and ct.endswith(
            "sparsity_config dense 2:4 (0.500)"), ct
        assert s["hf"]["compressed_tensors_dir"] == str(run_dir / "hf-compressed-tensors")
    else:
        why = ("compressed-tensors package is not installed" if "fp8" in recipe
               else "model is not quantized")
        assert ct.startswith(f"skipped: the {why}"), ct
        assert not (run_dir / "hf-compressed-tensors").exists()
    hf_dir = run_dir / "hf"
    assert (hf_dir / "sparsekit.safetensors").exists()
    assert transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True).vocab_size
    cls = (transformers.AutoModelForCausalLM if model == "llama"
           else transformers.AutoModelForMaskedLM)
    exported = cls.from_pretrained(hf_dir, local_files_only=True).eval()
    pruned = sk.load(hf_dir / "sparsekit.safetensors").eval()
    for name, layer in select_modules(exported, exclude=[HEAD]).items():
        groups = layer.weight.reshape(layer.weight.shape[0], -1, 4)
        assert (groups != 0).sum(-1).le(2).all(), name
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = exported(ids).logits
        if "fp8" in recipe:  # hf/ holds the fp8 weights dequantized; activations stay float
            layer = pruned.get_submodule(next(iter(select_modules(exported, exclude=[HEAD]))))
            assert layer.weight.dtype == torch.float8_e4m3fn
            name = next(iter(select_modules(exported, exclude=[HEAD])))
            torch.testing.assert_close(exported.get_submodule(name).weight,
                                       layer.dequantized_weight(torch.float32), rtol=0, atol=0)
            if compressed_tensors_available():  # the same fp8 values and scales, the same
                # activation numerics (W8A8, or W8A16 for fp8w)
                ct = cls.from_pretrained(run_dir / "hf-compressed-tensors",
                                         local_files_only=True).eval()
                torch.testing.assert_close(ct(ids).logits, pruned(ids).logits,
                                           rtol=1e-5, atol=1e-5)
        else:  # the very model the run pruned, evaluated as from_pretrained gives it
            torch.testing.assert_close(got, pruned(ids).logits, rtol=0, atol=0)
    # what hf/ holds, and how far its outputs are from the measured model's (in the run)
    hf, weight_only = s["hf"], recipe.endswith(("_24", "distill", "fp8w"))
    if "fp8" not in recipe:
        assert hf["holds"] == "the measured weights" and hf["max_abs_diff"] == 0.0
    elif weight_only:  # float activations on both sides
        assert hf["holds"] == "dequantized fp8_weight_only weights"
        assert hf["max_abs_diff"] < 1e-4
    else:  # W8A8: hf/ leaves the activations in float
        assert hf["holds"].endswith("weights; no activation quantization (the measured model "
                                    "quantizes them)") and hf["max_abs_diff"] > 0
        assert (got - pruned(ids).logits).abs().max() > 0
    assert f"its outputs differ from the measured model's by up to {hf['max_abs_diff']:.3g}" \
        in out
    if "compressed_tensors_dir" in hf:  # the same numerics as the measured model
        assert hf["compressed_tensors_max_abs_diff"] < 1e-3


def test_config_built_model_with_a_tokenizer_dir(hf_dirs, tmp_path, capsys):
    config = ("model.config={model_type:llama,vocab_size:300,hidden_size:32,"
              "intermediate_size:64,num_hidden_layers:1,num_attention_heads:2,"
              "num_key_value_heads:2}")
    code, _, err = run_cli(["recipe=llm_sparsegpt_24", config,
                            f"data.tokenizer={hf_dirs['llama']}", f"data.path={hf_dirs['text']}",
                            f"cache_dir={tmp_path / 'c'}", *TINY], tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["dense_source"] == "hf model.config (random weights)" and s["sparsity"] == 0.5
    back = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert back.config.num_hidden_layers == 1


@pytest.mark.parametrize(("args", "expected"), [
    (["model.path={tmp}/missing"], "no such directory"),
    (["model.path={tmp}"], "has no config.json"),
    (["data.path={tmp}/missing.txt"], "no such file or directory"),
    (["data.path={tmp}/empty.txt"], "holds no text"),
    (["data.path={tmp}/short.txt"], "is too short"),
    (["model.path=null"], "model=hf needs exactly one of model.path=DIR"),
])
def test_bad_paths_are_one_line(args, expected, hf_dirs, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("def f(): pass\n")
    defaults = {"model.path": str(hf_dirs["llama"]), "data.path": str(hf_dirs["text"])}
    given = [a.format(tmp=tmp_path) for a in args]
    rest = [f"{k}={v}" for k, v in defaults.items() if not any(a.startswith(k) for a in given)]
    code, _, err = run_cli(["recipe=llm_sparsegpt_24", *given, *rest, *TINY], tmp_path, capsys)
    assert code in (1, 2)
    assert err.count("\n") == 1 and err.startswith("sparsekit: error: "), err
    assert expected in err, err


def test_missing_model_dir_from_a_real_process(hf_dirs, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sparsekit", "recipe=llm_sparsegpt_24",
         f"model.path={tmp_path / 'nope'}", f"data.path={hf_dirs['text']}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "SPARSEKIT_QUIET": "1"})
    assert proc.returncode in (1, 2)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no such directory" in proc.stderr


@pytest.mark.parametrize("recipe", ["llm_sparsegpt_24_int4", "llm_wanda_24_int4_qat"])
def test_llm_int4_recipes(recipe, hf_dirs, tmp_path, capsys):
    # the tiny Llama's inputs (32, 64) are not multiples of 128: one scale per output channel
    code, out, err = run_cli([f"recipe={recipe}", f"model.path={hf_dirs['llama']}",
                              f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}",
                              "quant.scheme=int4_weight_channel", *TINY], tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["sparsity"] >= 0.5 and s["quant"]["scheme"] == "int4_weight_channel"
    pruned = sk.load(run_dir / "model.safetensors").eval()
    layers = {n: m for n, m in pruned.named_modules() if isinstance(m, sk.quant.QuantLinear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape[1] == 1
        assert -8 <= int(layer.weight.min()) and int(layer.weight.max()) <= 7
        groups = layer.weight.reshape(layer.weight.shape[0], -1, 4)
        assert (groups != 0).sum(-1).le(2).all(), name
    # <run>/hf/ holds the int4 weights dequantized: from_pretrained gives the same logits
    exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf",
                                                                 local_files_only=True).eval()
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, pruned(ids).logits, rtol=0, atol=0)
    if recipe == "llm_sparsegpt_24_int4":  # the variants measured beside the joint sweep
        v = s["variants"]
        assert list(v) == ["dense", "2:4", "2:4+int4_weight_channel/rtn",
                           "2:4+int4_weight_channel/gptq"]
        assert v["dense"] == s["dense"]["perplexity"]
        assert v["2:4+int4_weight_channel/gptq"] == s["compressed"]["perplexity"]
    else:
        assert s["variants"] is None and s["finetune_steps"] == 3
    if compressed_tensors_available():
        assert s["hf"]["compressed_tensors"].startswith(
            "written: pack-quantized (int4_weight_channel, 14 layers)")
        ct = transformers.AutoModelForCausalLM.from_pretrained(
            run_dir / "hf-compressed-tensors", local_files_only=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(ct(ids).logits, pruned(ids).logits, rtol=0, atol=0)


def test_llm_run_reads_like_a_classifier_run_and_skips_tokens_per_s_off_gpu(
        hf_dirs, tmp_path, capsys):
    """Perplexity before/after and size in the end-of-run table and TensorBoard (dense and
    compressed runs, same tags); with accel=gpu on a CPU, the generation speed is skipped with
    a note, and the run's short name holds the model's basename, not its path."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code, out, err = run_cli(["recipe=llm_sparsegpt_24", f"model.path={hf_dirs['llama']}",
                              f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}",
                              *TINY, "tracker=tensorboard", "accel=gpu", "train.device=cpu"],
                             tmp_path, capsys)
    assert code == 0, err
    assert "generation speed skipped: needs a CUDA GPU" in out
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["generation"]["skipped"].startswith("needs a CUDA GPU")
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:4]]
            for ln in (run_dir / "summary.md").read_text().splitlines() if ln.startswith("| ")}
    assert rows["perplexity"] == [f"{s['dense']['perplexity']:.3f}",
                                  f"{s['compressed']['perplexity']:.3f}"]
    assert rows["size (bytes)"] == [f"{s['dense']['size_bytes']:,}",
                                    f"{s['compressed']['size_bytes']:,}"]
    assert rows["generation (tokens/s, b=1)"] == ["-", "-"]
    (logdir,) = (run_dir / "tb").iterdir()
    short = f"llm_sparsegpt_24,model={hf_dirs['llama'].name},data={hf_dirs['text'].name},"
    assert logdir.name.startswith(short) and len(logdir.name) <= 64, logdir.name
    tags = {}
    for side in ("dense", "compressed"):
        acc = EventAccumulator(str(logdir / side))
        acc.Reload()
        tags[side] = set(acc.Tags()["scalars"])
    assert {"eval/perplexity", "size/bytes"} <= tags["dense"] & tags["compressed"]
    assert not any(t.startswith("speed/") for t in tags["dense"] | tags["compressed"])


def test_generation_stage_times_dense_and_compressed_generate(hf_dirs, monkeypatch):
    """The stage's wiring, on CPU with the GPU check lifted: the dense model generates two
    ways (HF's static cache, sparsekit's dense generate on the same modules, here with dynamo
    and no inductor), the compressed model through the accelerated model's generate, each
    warmed up and then timed once a round; the dense figure is the faster dense way's, and
    every figure has p10/p90 in the run's speed figures and the table."""
    import copy
    from types import SimpleNamespace

    from sparsekit.run import bench, pipeline
    from sparsekit.run.config import Config

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["llama"]).eval()
    calls = []

    class Fast:  # stands in for AcceleratedModel: its generate, counted
        def generate(self, ids, **kwargs):
            calls.append(kwargs)
            return model.generate(ids, **kwargs)

    accelerate = sk.accelerate  # sparsekit's dense way on CPU: dynamo without inductor
    built = []

    def dense_accelerate(m, x, **kw):
        built.append(kw)
        return accelerate(m, x, **{**kw, "compile": sk.CompileOptions(backend="eager",
                                                                      warmup=False)})

    monkeypatch.setattr(pipeline.sk, "accelerate", dense_accelerate)
    order = []  # the ways in the order they were timed
    real_time = bench.time_samples_ms

    def spy(fn, device, **kw):
        order.append(fn.args[0])
        return real_time(fn, device, **kw)

    monkeypatch.setattr(bench, "time_samples_ms", spy)
    cfg = Config()
    cfg.accel.enabled = True
    cfg.bench.new_tokens, cfg.bench.prompt_tokens, cfg.bench.repeats, cfg.bench.warmup = 3, 5, 2, 1
    ctx = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), model=model,
                          dense=copy.deepcopy(model), fast=Fast(), tokenizer=None, quiet=True,
                          example=torch.randint(0, 300, (4, 16)), generation={},
                          speed={"dense": {}, "compressed": {}})
    monkeypatch.setattr(pipeline, "generation_skipped", lambda ctx: None)
    pipeline.stage_generate(ctx)
    assert built[0]["sparsity"] == "dense" and built[0]["precision"] == "bf16"
    assert len(calls) == 3 and calls[0]["min_new_tokens"] == 3  # 1 warm-up + 2 timed
    ways = ["hf_static_cache", "sparsekit", "compressed"]
    assert order == ways + ways[::-1]  # alternating rounds
    g = ctx.generation
    assert {k: g[k] for k in ("prompt_tokens", "new_tokens", "batch_size")} == {
        "prompt_tokens": 5, "new_tokens": 3, "batch_size": 1}
    assert set(g["dense_ways"]) == set(pipeline.DENSE_GENERATES)
    assert g["dense_way"] == max(g["dense_ways"], key=g["dense_ways"].get)
    assert ctx.speed["dense"]["tokens_per_s"] == g["dense_ways"][g["dense_way"]]
    for side in ("dense", "compressed"):
        sp = ctx.speed[side]
        assert 0 < sp["tokens_per_s_p10"] <= sp["tokens_per_s"] <= sp["tokens_per_s_p90"]
    assert ctx.dense.dtype == torch.bfloat16  # timed at the width accel runs
    assert pipeline.speedup(ctx.speed) == pytest.approx(
        ctx.speed["compressed"]["tokens_per_s"] / ctx.speed["dense"]["tokens_per_s"])
    summary = {"metric": "perplexity", "sparsity": 0.5, "tensorboard_logdir": "tb",
               "generation": ctx.generation,
               "dense": {"perplexity": 10.0, "size_bytes": 100, **ctx.speed["dense"]},
               "compressed": {"perplexity": 11.0, "size_bytes": 50, **ctx.speed["compressed"]}}
    table = pipeline.summary_table(summary)
    row = next(ln for ln in table.splitlines() if ln.startswith("| generation (tokens/s"))
    d = ctx.speed["dense"]
    assert f"{d['tokens_per_s']:,.1f} ({d['tokens_per_s_p10']:,.1f}-" in row
    assert f"dense is the faster dense way, {pipeline.DENSE_GENERATES[g['dense_way']]}" in table


@pytest.mark.gpu
def test_tokens_per_s_on_a_gpu(hf_dirs, tmp_path, capsys):
    """accel=gpu on CUDA: dense (the faster of HF's static cache, compiled, and sparsekit's
    dense generate) and compressed (fast.generate) generation speeds in the summary, with
    their spread."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code, _, err = run_cli(["recipe=llm_sparsegpt_24", f"model.path={hf_dirs['llama']}",
                            f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}",
                            *TINY, "accel=gpu", "bench.new_tokens=8", "bench.repeats=3",
                            "bench.warmup=1"], tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    for side in ("dense", "compressed"):
        assert 0 < s[side]["tokens_per_s_p10"] <= s[side]["tokens_per_s"] \
            <= s[side]["tokens_per_s_p90"]
    assert s["speedup"] == pytest.approx(s["compressed"]["tokens_per_s"]
                                         / s["dense"]["tokens_per_s"])
    ways = s["generation"]["dense_ways"]
    assert s["dense"]["tokens_per_s"] == ways[s["generation"]["dense_way"]] == max(ways.values())


def test_recovery_recipe_pauses_at_its_time_budget_and_resumes(hf_dirs, tmp_path, capsys):
    """llm_alps_recon_24_distill on a tiny Llama: ALPS + block reconstruction calibrated on
    text and teacher samples, bf16 distillation; train.max_minutes stops it after the first
    step (the line says so, exit 0, run state "paused"), resume=RUN_DIR finishes it with the
    fine-tuning's throughput in the summary."""
    tiny = [a for a in TINY if not a.startswith("train.finetune_steps")]
    args = ["recipe=llm_alps_recon_24_distill", f"model.path={hf_dirs['llama']}",
            f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}", *tiny,
            "train.finetune_steps=4", "train.finetune_warmup=0", "data.teacher_samples=8",
            "data.teacher_batch_size=4", "prune.options.reconstruct_steps=3",
            "prune.options.iters=20", "train.max_minutes=0.00001", "train.checkpoint_every=1"]
    code, out, err = run_cli(args, tmp_path, capsys)
    assert code == 0, err
    assert "paused: train.max_minutes=1e-05 reached at fine-tuning step 1 of 4" in out
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "run_state.json").read_text())["state"] == "paused"
    assert not (run_dir / "summary.json").exists()
    code, out, err = run_cli([f"resume={run_dir}", "train.max_minutes=0"], tmp_path, capsys)
    assert code == 0, err
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["sparsity"] == 0.5 and s["finetune_steps"] == 4
    assert s["finetune"]["steps_this_process"] == 3 and s["finetune"]["tokens_per_s"] > 0
    assert s["finetune"]["precision"] == "bf16"

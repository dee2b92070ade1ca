"""The PlanOptions fields that replaced the environment switches (SPARSEKIT_SK24_MMA,
SPARSEKIT_CSLT_EXT, SPARSEKIT_DECODE_ATTENTION, SPARSEKIT_LAGGED_STOP): checked when built,
current while accelerate builds the layers and while generate runs, and only then."""

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.accel.kernels import switches
from sparsekit.accel.kernels.cusparselt import ext as cslt_ext
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma


def test_fields_are_checked_and_map_to_the_switches():
    plan = sk.PlanOptions(mma_sp="all", cslt_epilogue=False, decode_attention=False,
                          lagged_stop=False)
    assert plan.switches() == switches.Switches("all", False, False, False)
    assert sk.PlanOptions().switches() == switches.Switches()
    with pytest.raises(ValueError, match=r"PlanOptions.mma_sp must be one of \('auto', 'all', "
                                         r"'off'\), got 'on'"):
        sk.PlanOptions(mma_sp="on")
    for name in ("cslt_epilogue", "decode_attention", "lagged_stop"):
        with pytest.raises(ValueError, match=f"PlanOptions.{name} must be True or False"):
            sk.PlanOptions(**{name: "no"})


def test_no_environment_variable_chooses_a_gpu_path(monkeypatch):
    for name in ("SPARSEKIT_SK24_MMA", "SPARSEKIT_CSLT_EXT", "SPARSEKIT_DECODE_ATTENTION",
                 "SPARSEKIT_LAGGED_STOP"):
        monkeypatch.setenv(name, "0")
    assert sk24_mma.enabled() and cslt_ext.enabled()
    assert switches.current() == switches.Switches()


@pytest.mark.parametrize("mma_sp", ["auto", "off"])
def test_accelerate_builds_the_layers_under_its_plan(monkeypatch, mma_sp):
    # what the layers see when they ask whether the mma.sp kernel may take their weight
    seen = []
    monkeypatch.setattr(sk24_mma, "usable", lambda w: seen.append(sk24_mma.enabled()) or False)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    sk.prune_(model, pattern="2:4", criterion="magnitude")
    fast = sk.accelerate(model, torch.randn(4, 128), device="cpu", compile=False,
                         plan=sk.PlanOptions(mma_sp=mma_sp))
    assert seen and set(seen) == {mma_sp != "off"}
    assert fast.plan.mma_sp == mma_sp
    assert sk24_mma.enabled()  # restored after accelerate


def test_generate_runs_under_the_models_plan(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from sparsekit.accel import generate

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (1, 5))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu", compile=False,
                         plan=sk.PlanOptions(decode_attention=False, lagged_stop=False))
    seen = []
    real = generate.attention_for
    monkeypatch.setattr(generate, "attention_for",
                        lambda m, d: seen.append(switches.current()) or real(m, d))
    fast.generate(ids, max_new_tokens=2)
    assert seen == [switches.Switches("auto", True, False, False)]
    assert switches.current() == switches.Switches()

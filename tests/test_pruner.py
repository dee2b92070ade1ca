import io
import math

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.prune.patterns import is_nm, prune_count


def mlp():
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8)
    )


def zeros(t):
    return int((t == 0).sum())


def test_layer_scope_exact_counts():
    model = mlp()
    sk.prune_(model, sparsity=0.7, scope="layer")
    for layer in (model[0], model[2], model[4]):
        assert zeros(layer.weight) == prune_count(layer.weight.numel(), 0.7)


def test_global_scope_exact_count_and_threshold_reference():
    model = mlp()
    weights = [m.weight.detach().clone() for m in (model[0], model[2], model[4])]
    report = sk.prune_(model, sparsity=0.8, scope="global")
    total = sum(w.numel() for w in weights)
    assert report.zeros == prune_count(total, 0.8)
    # reference: float64 sort of all magnitudes; every pruned <= every kept
    k = prune_count(total, 0.8)
    threshold = torch.cat([w.abs().flatten().double() for w in weights]).sort().values[k - 1]
    for w, layer in zip(weights, (model[0], model[2], model[4])):
        pruned = layer.weight == 0
        assert (w[pruned].abs().double() <= threshold).all()
        assert (w[~pruned].abs().double() >= threshold).all()


@pytest.mark.parametrize("pattern", ["2:4", "1:4", "4:8"])
def test_nm_every_group_valid(pattern):
    n, m = map(int, pattern.split(":"))
    model = mlp()
    report = sk.prune_(model, pattern=pattern)
    for layer in (model[0], model[2], model[4]):
        groups = (layer.weight != 0).reshape(layer.weight.shape[0], -1, m)
        assert (groups.sum(-1) == n).all()
    assert report.global_sparsity == pytest.approx(1 - n / m)


def test_conv_nm_groups_along_flattened_input():
    conv = nn.Conv2d(4, 8, 3)  # flattened input 4*3*3 = 36, divisible by 4
    model = nn.Sequential(conv)
    w = conv.weight.detach().clone()
    sk.prune_(model, pattern="2:4")
    flat = conv.weight.reshape(8, -1, 4)
    assert ((flat != 0).sum(-1) == 2).all()
    # the kept pair of each group is the two largest |w| of that group of the (in, kh, kw) order
    ref = w.reshape(8, -1, 4).abs().topk(2, dim=-1).indices.sort(-1).values
    got = (flat != 0).nonzero()[:, -1].reshape(8, -1, 2)
    assert torch.equal(ref, got)


def test_skipped_layers_reported_and_strict_raises():
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 6), nn.Linear(6, 3))
    pruner = sk.Pruner(model, pattern="2:4")
    pruner.step(0)
    report = pruner.report()
    assert "2" in report.skipped and "6" in report.skipped["2"]
    assert report.layers["2"].zeros == 0
    assert "skipped" in str(report)
    with pytest.raises(ValueError, match="layer '2'"):
        sk.Pruner(
            nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 6), nn.Linear(6, 3)),
            pattern="2:4",
            strict=True,
        )


def test_wanda_matches_paper_score():
    torch.manual_seed(1)
    layer = nn.Linear(12, 5, bias=False)
    model = nn.Sequential(layer)
    batches = [torch.randn(7, 12) * torch.linspace(0.1, 3, 12) for _ in range(3)]
    w = layer.weight.detach().clone()
    x = torch.cat(batches).double()
    score = w.abs().double() * x.norm(dim=0)  # |W_ij| * ||X_j||_2
    k = prune_count(12, 0.5)
    expected = torch.ones_like(w, dtype=torch.bool)
    expected.scatter_(1, score.topk(k, dim=1, largest=False).indices, False)
    sk.prune_(model, sparsity=0.5, criterion="wanda", calibration=batches)
    assert torch.equal(layer.weight != 0, expected)


def test_wanda_conv_uses_unfolded_patches():
    conv = nn.Conv1d(2, 4, 3, padding=1, bias=False)
    batches = [torch.randn(3, 2, 10)]
    w = conv.weight.detach().clone()
    cols = torch.nn.functional.unfold(batches[0].unsqueeze(2), (1, 3), padding=(0, 1))
    norm = cols.transpose(1, 2).reshape(-1, 6).double().norm(dim=0)
    score = w.reshape(4, 6).abs().double() * norm
    expected = score.reshape(4, -1, 2).topk(1, dim=-1).indices
    sk.prune_(nn.Sequential(conv), pattern="1:2", criterion="wanda", calibration=batches)
    got = (conv.weight.reshape(4, -1, 2) != 0).float().argmax(-1, keepdim=True)
    assert torch.equal(got, expected)


def test_gradual_masks_monotone_and_reach_target():
    model = mlp()
    pruner = sk.Pruner(model, sparsity=0.9, scope="global", schedule=sk.Cubic(0, 100, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    prev = {n: m.clone() for n, m in pruner.masks.items()}
    levels = []
    for step in range(120):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if pruner.step(step):
            for name, mask in pruner.masks.items():
                assert not (mask & ~prev[name]).any(), "a pruned weight came back"
                prev[name] = mask.clone()
            levels.append(pruner.report().global_sparsity)
    assert levels == sorted(levels)
    assert levels[-1] == pytest.approx(0.9, abs=1e-3)


def test_nm_gradual_ramp_fraction_of_groups():
    model = mlp()
    pruner = sk.Pruner(model, pattern="2:4", schedule=sk.Linear(0, 100, 25))
    pruner.step(50)  # half the groups enforced
    for mask in pruner.masks.values():
        groups = mask.reshape(mask.shape[0], -1, 4).sum(-1)
        assert ((groups == 2) | (groups == 4)).all()
        assert (groups == 2).float().mean().item() == pytest.approx(0.5, abs=0.01)
    pruner.step(100)
    assert all(is_nm(m.weight, 2, 4) for m in (model[0], model[2], model[4]))


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_masks_survive_optimizer_with_weight_decay(opt_name):
    model = mlp()
    pruner = sk.Pruner(model, sparsity=0.75, schedule=sk.OneShot(0))
    params = list(model.parameters())
    opt = (
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if opt_name == "adamw"
        else torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1)
    )
    # momentum built up before pruning must not revive pruned weights either
    for _ in range(5):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    pruner.step(0)
    pruned = {n: ~m.clone() for n, m in pruner.masks.items()}
    for _ in range(200):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        pruner.step(1)
    for name, layer in pruner.modules.items():
        assert (layer.weight[pruned[name]] == 0).all()
    pruner.finalize()
    for name in pruned:
        assert (dict(model.named_modules())[name].weight[pruned[name]] == 0).all()


def test_finalize_plain_module_same_keys():
    model = mlp()
    keys = list(model.state_dict())
    pruner = sk.Pruner(model, sparsity=0.5)
    pruner.step(0)
    pruner.finalize()
    assert list(model.state_dict()) == keys
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not any(hasattr(m, "parametrizations") for m in model.modules())


def run_schedule(model, pruner, steps, seed=0, start=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(16, 32, generator=gen)
        if step < start:
            continue
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        pruner.step(step)


def test_state_round_trip_mid_schedule_identical_masks():
    torch.manual_seed(3)
    reference = mlp()
    resumed = mlp()
    resumed.load_state_dict(reference.state_dict())
    sched = sk.Linear(start=0, end=60, every=10)
    p_ref = sk.Pruner(reference, sparsity=0.8, scope="global", schedule=sched)
    run_schedule(reference, p_ref, 80)

    p1 = sk.Pruner(resumed, sparsity=0.8, scope="global", schedule=sched)
    opt = torch.optim.SGD(resumed.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    for step in range(35):
        resumed(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        p1.step(step)
    buf = io.BytesIO()
    torch.save({"pruner": p1.state_dict(), "model": resumed.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    fresh = mlp()
    p2 = sk.Pruner(fresh, sparsity=0.8, scope="global", schedule=sched)
    fresh.load_state_dict(state["model"])
    p2.load_state_dict(state["pruner"])
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.05)
    for step in range(35, 80):
        fresh(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt2.step()
        opt2.zero_grad()
        p2.step(step)
    for name in p_ref.masks:
        assert torch.equal(p_ref.masks[name], p2.masks[name])


def test_include_exclude_and_mapping():
    model = mlp()
    pruner = sk.Pruner(model, sparsity={"0": 0.5, "*": 0.25}, exclude=["4"])
    pruner.step(0)
    assert set(pruner.modules) == {"0", "2"}
    assert zeros(model[0].weight) == prune_count(model[0].weight.numel(), 0.5)
    assert zeros(model[2].weight) == prune_count(model[2].weight.numel(), 0.25)
    assert zeros(model[4].weight) == 0
    pruner = sk.Pruner(mlp(), sparsity=0.5, include=["re:[02]"])
    assert set(pruner.modules) == {"0", "2"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sparsity": 1.0}, r"\[0, 1\)"),
        ({"sparsity": -0.1}, r"\[0, 1\)"),
        ({"sparsity": 0.5, "pattern": "blocky"}, "unknown pattern"),
        ({"pattern": "4:2"}, "0 < N < M"),
        ({"pattern": "4:4"}, "0 < N < M"),
        ({"sparsity": 0.5, "include": ["decoder.*"]}, "'decoder.*' matches no"),
        ({"sparsity": 0.5, "exclude": ["nope"]}, "'nope' matches no"),
        ({"sparsity": 0.5, "criterion": "random"}, "unknown criterion"),
        ({"sparsity": 0.5, "scope": "model"}, "unknown scope"),
        ({"sparsity": 0.5, "criterion": "wanda"}, "calibration"),
        ({"pattern": "2:4", "sparsity": 0.9}, "implied"),
        ({}, "sparsity is required"),
    ],
)
def test_bad_input_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sk.Pruner(mlp(), **kwargs)


def test_sparsity_report_table_and_dict():
    model = mlp()
    sk.prune_(model, pattern="2:4")
    report = sk.sparsity_report(model, pattern="2:4")
    d = report.to_dict()
    assert (
        d["global"]["zeros"]
        == report.zeros
        == sum(zeros(m.weight) for m in model if isinstance(m, nn.Linear))
    )
    assert all(layer["nm_ok"] for layer in d["layers"].values())
    assert report.scalars()["sparsity/global"] == pytest.approx(0.5)
    assert "global" in str(report) and "2:4 ok" in str(report)


def _forward_ok(model, *inputs, **kw):
    model.eval()
    with torch.no_grad():
        return model(*inputs, **kw)


def test_torchvision_resnet_and_vit():
    tv = pytest.importorskip("torchvision")
    resnet = tv.models.resnet18(num_classes=10)
    report = sk.prune_(resnet, pattern="2:4")
    # the stem conv has 3*7*7 = 147 inputs: not a multiple of 4 -> skipped, reason reported
    assert "conv1" in report.skipped
    assert report.layers["layer1.0.conv1"].nm_ok
    assert _forward_ok(resnet, torch.randn(1, 3, 32, 32)).shape == (1, 10)

    vit = tv.models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=5,
    )
    report = sk.prune_(vit, sparsity=0.5, scope="global")
    assert report.global_sparsity == pytest.approx(0.5, abs=1e-6)
    assert _forward_ok(vit, torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_hf_bert_and_llama_from_config():
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    )
    ids = torch.randint(0, 100, (2, 8))
    calib = [{"input_ids": ids}]
    report = sk.prune_(bert, pattern="2:4", criterion="wanda", calibration=calib)
    assert all(s.nm_ok for s in report.layers.values() if not s.skipped)
    assert _forward_ok(bert, input_ids=ids).last_hidden_state.shape == (2, 8, 32)

    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )
    keys = list(llama.state_dict())
    pruner = sk.Pruner(
        llama, pattern="2:4", exclude=["lm_head"], schedule=sk.Linear(start=0, end=4, every=2)
    )
    opt = torch.optim.AdamW(llama.parameters(), lr=1e-3)
    for step in range(5):
        out = llama(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        pruner.step(step)
    pruner.finalize()
    assert list(llama.state_dict()) == keys
    assert is_nm(llama.model.layers[0].mlp.down_proj.weight, 2, 4)
    assert math.isfinite(_forward_ok(llama, input_ids=ids).logits.sum().item())


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int8_weight_only"])
def test_sparsity_report_counts_quantized_layers(scheme):
    model = mlp()
    sk.prune_(model, pattern="2:4")
    sk.quantize_(model, scheme)
    report = sk.sparsity_report(model, pattern="2:4")
    assert set(report.layers) == {"0", "2", "4"}
    assert report.global_sparsity == pytest.approx(0.5)
    assert all(layer.nm_ok for layer in report.layers.values())

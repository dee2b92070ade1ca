"""Structured channel pruning: shapes, counts, whole heads, round trips, schedules, errors."""

import copy
import json

import pytest
import torch
import torch_pruning as tp
from safetensors.torch import load_file, save_file
from torch import nn

import sparsekit as sk
from sparsekit.prune.channels import (
    ChannelPruner,
    apply_channel_plan,
    channel_plan,
    prune_channels_,
)
from sparsekit.errors import UsageError
from sparsekit.models import mnist1d_cnn

torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")


def tiny_vit():
    return torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=10,
    )


def tiny_bert():
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
    )
    return transformers.BertModel(cfg).eval()


def bert_inputs(batch=2):
    ids = torch.randint(0, 100, (batch, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


FAMILIES = {
    "mnist1d_cnn": (mnist1d_cnn, lambda: torch.randn(2, 1, 40)),
    "resnet18": (
        lambda: torchvision.models.resnet18(num_classes=10),
        lambda: torch.randn(2, 3, 32, 32),
    ),
    "resnet50": (
        lambda: torchvision.models.resnet50(num_classes=10),
        lambda: torch.randn(1, 3, 32, 32),
    ),
    "mobilenet_v2": (
        lambda: torchvision.models.mobilenet_v2(num_classes=10),
        lambda: torch.randn(2, 3, 32, 32),
    ),
    "vit": (tiny_vit, lambda: torch.randn(2, 3, 32, 32)),
    "bert": (tiny_bert, bert_inputs),
}


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return tp.utils.flatten_as_list(out)


def reference_macs(model, inputs):
    """Multiply-accumulates of the Conv/Linear layers and attention matmuls, counted from the
    shapes seen in one forward pass (independent of torch-pruning's counter)."""
    total = [0]

    def conv(m, i, o):
        total[0] += o.numel() * (m.in_channels // m.groups) * m.weight[0, 0].numel()

    def linear(m, i, o):
        total[0] += o.numel() * m.in_features

    handles = []
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            handles.append(m.register_forward_hook(conv))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear))
    model.eval()
    run(model, inputs)
    for h in handles:
        h.remove()
    return total[0]


@pytest.fixture(params=list(FAMILIES), scope="module")
def pruned(request):
    """(name, dense model, pruned model, inputs, report) for each family at ratio 0.5."""
    torch.manual_seed(0)
    build, make_inputs = FAMILIES[request.param]
    inputs = make_inputs()
    dense = build().eval()
    model = build().eval()
    model.load_state_dict(dense.state_dict())
    report = prune_channels_(model, inputs, ratio=0.5)
    return request.param, build, dense, model, inputs, report


def test_output_shapes_and_forward_after_pruning(pruned):
    name, _, dense, model, inputs, report = pruned
    before, after = run(dense, inputs), run(model, inputs)
    assert [t.shape for t in after] == [t.shape for t in before]
    assert all(torch.isfinite(t).all() for t in after)
    assert report.channels_after < report.channels_before
    other_batch = {k: v[:1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:1]
    assert run(model, other_batch)[0].shape[0] == 1


def test_parameter_and_mac_counts_match_the_report(pruned):
    name, _, dense, model, inputs, report = pruned
    assert report.params_before == sum(p.numel() for p in dense.parameters())
    assert report.params_after == sum(p.numel() for p in model.parameters())
    assert report.params_removed == pytest.approx(1 - report.params_after / report.params_before)
    # The report's MACs (torch-pruning's counter) against an independent count of the dominant
    # Conv/Linear MACs: the removed fractions agree to within the small non-matmul terms.
    ref = 1 - reference_macs(model, inputs) / reference_macs(dense, inputs)
    assert report.macs_removed == pytest.approx(ref, abs=0.06)
    assert report.macs_after < report.macs_before


def test_widths_follow_the_ratio_and_round_to(pruned):
    name, _, dense, model, inputs, report = pruned
    for layer, (before, after) in report.layers.items():
        if layer in report.protected or after == before:
            continue
        assert after % 8 == 0 and after >= 8, (layer, before, after)
    if name in ("resnet18", "resnet50"):
        # every conv keeps int(c * 0.5) rounded down to 8 (all ResNet widths are multiples of 16)
        for layer, (before, after) in report.layers.items():
            if layer != "fc":
                assert after == before // 2, (layer, before, after)
        assert report.layers["fc"] == (dense.fc.out_features, dense.fc.out_features)
    if name == "mnist1d_cnn":
        assert [model.conv1.out_channels, model.conv2.out_channels, model.conv3.out_channels] == [
            16,
            16,
            16,
        ]


def test_attention_loses_whole_heads():
    torch.manual_seed(0)
    dense = tiny_bert()
    model = tiny_bert()
    model.load_state_dict(dense.state_dict())
    report = prune_channels_(model, bert_inputs(), ratio=0.5, steps=2)
    for i, layer in enumerate(model.encoder.layer):
        att = layer.attention.self
        assert att.num_attention_heads == 2 and att.attention_head_size == 16
        assert report.heads[f"encoder.layer.{i}.attention.self"] == (4, 2)
        # the kept query rows are two complete heads of the dense query weight
        w_dense = dense.encoder.layer[i].attention.self.query.weight.view(4, 16, -1)
        kept = [
            h
            for h in range(4)
            if any(torch.equal(w_dense[h], b) for b in att.query.weight.view(2, 16, -1))
        ]
        assert len(kept) == 2
        assert torch.equal(att.query.weight.view(2, 16, -1), w_dense[kept])
    # the hidden size reaches the output (last_hidden_state) and is kept
    assert model.embeddings.word_embeddings.embedding_dim == 64


def test_multihead_attention_loses_whole_heads():
    dense = tiny_vit().eval()
    model = tiny_vit().eval()
    model.load_state_dict(dense.state_dict())
    x = torch.randn(2, 3, 32, 32)
    report = prune_channels_(model, x, ratio=0.5, round_to=1)
    for block in model.encoder.layers:
        mha = block.self_attention
        assert (mha.num_heads, mha.head_dim, mha.embed_dim) == (2, 16, 32)
        assert mha.in_proj_weight.shape == (96, 32)
    assert report.heads["encoder.layers.encoder_layer_0.self_attention"] == (4, 2)
    assert model.hidden_dim == 32 and model.class_token.shape[-1] == 32
    assert run(model, x)[0].shape == (2, 10)


def test_iterative_pruning_reaches_the_final_ratio():
    x = torch.randn(1, 3, 32, 32)
    one = torchvision.models.resnet18(num_classes=10)
    many = torchvision.models.resnet18(num_classes=10)
    r1 = prune_channels_(one, x, ratio=0.5)
    r3 = prune_channels_(many, x, ratio=0.5, steps=3)
    assert {k: v[1] for k, v in r3.layers.items()} == {k: v[1] for k, v in r1.layers.items()}
    assert r3.params_after == r1.params_after


def test_schedule_prunes_only_when_progress_rises():
    model = mnist1d_cnn()
    x = torch.randn(2, 1, 40)
    pruner = ChannelPruner(
        model, x, ratio=0.5, round_to=1, schedule=sk.Linear(start=0, end=40, every=20)
    )
    widths = []
    for step in range(0, 50, 10):
        changed = pruner.step(step)
        widths.append((step, changed, model.conv2.out_channels))
    assert widths == [
        (0, False, 32),
        (10, False, 32),
        (20, True, 24),
        (30, False, 24),
        (40, True, 16),
    ]
    one_shot = ChannelPruner(mnist1d_cnn(), x, ratio=0.5)  # default schedule: all at step 0
    assert one_shot.step() and one_shot.model.conv2.out_channels == 16 and not one_shot.step(5)


def test_pruning_interleaved_with_fine_tuning():
    """Widths shrink on the schedule while training goes on with a rebuilt optimizer."""
    model = mnist1d_cnn()
    x, y = torch.randn(64, 1, 40), torch.randint(0, 10, (64,))
    pruner = ChannelPruner(
        model, x[:1], ratio=0.5, round_to=4, schedule=sk.Linear(start=0, end=20, every=10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if pruner.step(step):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses.append(loss.item())
    assert model.conv2.out_channels == 16 and model.linear.in_features == 16 * 5
    assert all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("importance", ["magnitude", "lamp", "taylor"])
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_importances_and_scopes(importance, scope):
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    y = torch.tensor([1, 2])

    def loss_fn(m):
        return nn.functional.cross_entropy(m(x), y)

    report = prune_channels_(
        model, x, ratio=0.5, criterion=importance, scope=scope, loss_fn=loss_fn
    )
    assert run(model, x)[0].shape == (2, 10)
    # global ranking removes the same fraction overall, unevenly; rounding takes a little more
    assert 0.45 <= report.channels_removed <= 0.56
    if scope == "global" and importance != "taylor":
        assert len({round(a / b, 3) for b, a in report.layers.values()}) > 2


def test_pruning_leaves_training_mode_and_batchnorm_statistics_alone():
    model = torchvision.models.resnet18(num_classes=10).train()
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    prune_channels_(model, torch.randn(2, 3, 32, 32), ratio=0.0)
    assert model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stats.items())
    prune_channels_(model, torch.randn(2, 3, 32, 32), ratio=0.5)
    assert model.training and model.layer1[0].bn1.running_mean.shape == (32,)


def test_ignore_and_round_to():
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(1, 3, 32, 32)
    report = prune_channels_(model, x, ratio=0.3, round_to=16, exclude=["layer4.*"])
    assert model.layer4[1].conv1.out_channels == 512
    for layer, (_, after) in report.layers.items():
        assert after % 16 == 0 or layer == "fc"
        if layer.startswith("layer1.0.conv1"):
            assert after == 32  # int(64 * 0.7) = 44, rounded down to 32


def test_plan_round_trip_rebuilds_architecture_and_outputs(pruned, tmp_path):
    name, build, dense, model, inputs, report = pruned
    plan = json.loads(json.dumps(channel_plan(model)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "w.st")
    fresh = apply_channel_plan(build().eval(), plan)
    fresh.load_state_dict(load_file(tmp_path / "w.st"))
    assert str(fresh) == str(model)
    for a, b in zip(run(fresh, inputs), run(model, inputs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_round_trip_with_weights_only_torch_load(tmp_path):
    model = torchvision.models.mobilenet_v2(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    prune_channels_(model, x, ratio=0.4)
    torch.save({"plan": channel_plan(model), "state": model.state_dict()}, tmp_path / "c.pt")
    blob = torch.load(tmp_path / "c.pt", weights_only=True)
    fresh = apply_channel_plan(torchvision.models.mobilenet_v2(num_classes=10).eval(), blob["plan"])
    fresh.load_state_dict(blob["state"])
    torch.testing.assert_close(run(fresh, x)[0], run(model, x)[0], rtol=0, atol=0)


def test_sk_save_and_load_rebuild_pruned_model(tmp_path):
    model = mnist1d_cnn().eval()
    x = torch.randn(4, 1, 40)
    prune_channels_(model, x, ratio=0.3, round_to=4)
    sk.save(model, tmp_path / "m.safetensors")
    back = sk.load(tmp_path / "m.safetensors", model=mnist1d_cnn().eval())
    assert back.conv1.out_channels == 20
    torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)


def test_sk_load_rebuilds_a_pruned_torchvision_model_from_its_spec(tmp_path):
    """No model passed to sk.load: the stored factory spec builds it, the plan reshapes it."""
    from sparsekit.models import build_model

    model = build_model("resnet18", kwargs={"num_classes": 10}).eval()
    x = torch.randn(1, 3, 32, 32)
    prune_channels_(model, x, ratio=0.5)
    sk.save(model, tmp_path / "r.safetensors")
    back = sk.load(tmp_path / "r.safetensors").eval()
    assert str(back) == str(model)
    torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)


def test_composition_channels_then_2to4_then_quantization(tmp_path):
    """Channel pruning, then 2:4 masks on what remains, then int8 weights: saved and rebuilt."""
    quant = pytest.importorskip("sparsekit.quant")
    model = mnist1d_cnn().eval()
    x = torch.randn(4, 1, 40)
    prune_channels_(model, x, ratio=0.3, round_to=4)
    sk.prune_(model, pattern="2:4", exclude=["conv1"])
    assert (model.conv2.weight.flatten(1).view(-1, 4) != 0).sum(1).max() <= 2
    quant.quantize_(model, "int8_weight_only")
    expected = model(x)
    sk.save(model, tmp_path / "m.safetensors")
    back = sk.load(tmp_path / "m.safetensors", model=mnist1d_cnn().eval())
    torch.testing.assert_close(back(x), expected, rtol=0, atol=0)


def test_apply_plan_rejects_another_architecture():
    model = mnist1d_cnn()
    prune_channels_(model, torch.randn(1, 1, 40), ratio=0.5)
    plan = channel_plan(model)
    with pytest.raises(ValueError, match="not in the channel plan"):
        apply_channel_plan(torchvision.models.resnet18(), plan)
    with pytest.raises(ValueError, match="not a channel plan"):
        apply_channel_plan(mnist1d_cnn(), {"modules": {}})


class _Scale(nn.Module):
    """A per-channel scale whose forward hard-codes the width: pruning cannot follow it."""

    def __init__(self, channels):
        super().__init__()
        self.channels = channels
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x):
        return x * self.weight.view(1, 16, 1)


def test_unhandled_module_is_named_and_model_left_unchanged():
    model = nn.Sequential(nn.Conv1d(1, 16, 3), _Scale(16), nn.ReLU(), nn.Conv1d(16, 4, 3))
    x = torch.randn(2, 1, 20)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"module '1' \(_Scale\)") as info:
        prune_channels_(model, x, ratio=0.5)
    assert "exclude=['1']" in str(info.value)
    assert model[0].out_channels == 16
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    run(model, x)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ratio": 1.0}, ValueError, r"ratio=1.0 must be in \[0, 1\)"),
        ({"ratio": -0.1}, ValueError, "fraction of output channels"),
        ({"ratio": float("nan")}, ValueError, "ratio"),
        ({"ratio": "0.5"}, TypeError, "ratio must be a number"),
        ({"ratio": 0.5, "criterion": "l1"}, ValueError, "magnitude, taylor, lamp"),
        ({"ratio": 0.5, "scope": "model"}, ValueError, "layer, global"),
        ({"ratio": 0.5, "round_to": 0}, ValueError, "round_to=0"),
        ({"ratio": 0.5, "steps": 0}, ValueError, "steps=0"),
        ({"ratio": 0.5, "criterion": "taylor"}, ValueError, "loss_fn"),
        ({"ratio": 0.5, "exclude": ["conv9"]}, ValueError, "'conv9' matches no module"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        prune_channels_(mnist1d_cnn(), torch.randn(1, 1, 40), **kwargs)


def test_masked_model_is_refused():
    model = mnist1d_cnn()
    sk.Pruner(model, pattern="2:4", exclude=["conv1"]).step(0)
    with pytest.raises(ValueError, match="before mask pruning"):
        prune_channels_(model, torch.randn(1, 1, 40), ratio=0.5)


def test_report_is_plain_data_and_a_table():
    model = mnist1d_cnn()
    report = prune_channels_(model, torch.randn(1, 1, 40), ratio=0.5)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["layers"]["conv1"] == [32, 16] and d["layers"]["linear"] == [10, 10]
    assert d["protected"] == ["linear"]
    assert "parameters removed" in str(report) and "conv2" in str(report)
    scalars = report.scalars()
    assert scalars["channels/conv1"] == 0.5 and scalars["channels/linear"] == 0.0
    assert scalars["channels/params_removed"] == report.params_removed
    assert scalars["channels/removed"] == (3 * 16) / (3 * 32 + 10)


TINY = [
    "data.kwargs.num_samples=300",
    "train.dense_steps=40",
    "train.finetune_steps=20",
    "train.log_every=10",
    "train.eval_every=10",
    "train.checkpoint_every=10",
    "schedule.end=10",
    "schedule.every=5",
    "bench.repeats=2",
    "bench.batch_size=16",
    "train.quiet=true",
    "tracker=none",
]


def run_recipe(args, tmp_path):
    cli = pytest.importorskip("sparsekit.run.cli")
    cli.main([f"cache_dir={tmp_path / 'cache'}", "hydra.run.dir=run", *args])
    return tmp_path / "run"


def test_channel_recipes_compose_and_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = run_recipe(["recipe=mnist1d_channel30", *TINY, "tracker=tensorboard"], tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = (run_dir / "tb").iterdir()
    acc = EventAccumulator(str(logdir / "compressed"), size_guidance={"tensors": 0})
    acc.Reload()
    # the channel report is text and the per-layer figure, not a group of one-point charts
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("channels/")]
    assert "channels/text_summary" in acc.Tags()["tensors"]
    assert "sparsity/by_layer" in acc.Tags()["images"]
    cfg = (run_dir / "config.yaml").read_text()
    assert "ratio: 0.3" in cfg and "alpha: 0.9" in cfg
    state = load_file(run_dir / "model.safetensors")
    assert [state[f"conv{i}.weight"].shape[0] for i in (1, 2, 3)] == [22, 22, 22]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compressed"]["accuracy"] > 0.1 and summary["sparsity"] == 0
    channels = summary["channels"]  # the channel report reaches the summary
    assert channels["channels_removed"] == pytest.approx(1 - 22 / 32, abs=0.05)
    assert 0 < channels["params_removed"] < 1

    # Taylor importance from the command line gets a loss on training batches
    run_recipe(["recipe=mnist1d_channel30", *TINY, "prune.channel.criterion=taylor",
                "hydra.run.dir=run_t"], tmp_path)
    summary = json.loads((tmp_path / "run_t" / "summary.json").read_text())
    assert summary["channels"]["channels_removed"] > 0.2

    run_dir = run_recipe(
        [
            "recipe=resnet18_channel50_synthetic",
            "data.kwargs.image_size=32",
            "bench.repeats=1",
            "hydra.run.dir=run_r18",
        ],
        tmp_path,
    )
    state = load_file(tmp_path / "run_r18" / "model.safetensors")
    assert state["layer1.0.conv1.weight"].shape[0] == 32 and state["fc.weight"].shape == (10, 256)

    run_dir = run_recipe(
        ["recipe=mnist1d_channel25_24_int8", *TINY, "hydra.run.dir=run_c"], tmp_path
    )
    summary = json.loads((tmp_path / "run_c" / "summary.json").read_text())
    assert summary["sparsity"] > 0.4  # 2:4 on every layer but conv1 (5 inputs)
    state = load_file(tmp_path / "run_c" / "model.safetensors")
    assert state["conv1.weight"].shape[0] == 24  # int(32 * 0.75), a multiple of 8
    assert state["conv1.weight"].dtype == torch.int8  # quantized after pruning


def test_channel_pruner_and_pruner_share_the_scheduled_protocol(tmp_path):
    """What a run loop drives: step / done / report / state_dict / load_state_dict / finalize.
    A channel pruner restored from its state_dict on a fresh model continues exactly like the
    one that was never interrupted; fit keeps the optimizer on the replaced parameters."""
    from sparsekit.io.runstate import follow_parameters
    from sparsekit.prune.scheduled import ScheduledPruner
    from sparsekit.run.train import fit

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 3))
        pruner = ChannelPruner(model, torch.randn(1, 8), ratio=0.5, round_to=1,
                               schedule=sk.Linear(start=0, end=4, every=2))
        return model, pruner, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    train = dict(lr=0.1, batch_size=16, seed=0, lr_schedule="constant", quiet=True)
    model, pruner, opt = make()
    assert isinstance(pruner, ScheduledPruner)
    assert isinstance(sk.Pruner(nn.Sequential(nn.Linear(4, 4)), sparsity=0.5), ScheduledPruner)
    fit(model, data, opt, steps=3, pruner=pruner, **train)
    assert not pruner.done and 0 < pruner.progress < 0.5
    # the optimizer follows the narrower Parameters the channel step made
    assert list(map(id, opt.param_groups[0]["params"])) == list(map(id, model.parameters()))
    state = pruner.state_dict()
    weights, optim = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    json.dumps(state)  # plain data
    fit(model, data, opt, steps=6, start_step=3, pruner=pruner, **train)
    assert pruner.done and pruner.finalize() is model

    fresh, again, opt2 = make()  # a resumed run: fresh model, state loaded in this order
    again.load_state_dict(state)
    follow_parameters(opt2, fresh)
    fresh.load_state_dict(weights)
    opt2.load_state_dict(optim)
    fit(fresh, data, opt2, steps=6, start_step=3, pruner=again, **train)
    assert channel_plan(fresh) == channel_plan(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    with pytest.raises(UsageError, match="'plan' and 'progress'"):
        again.load_state_dict({"progress": 0.5})


class _KeepFirst(tp.importance.Importance):
    """A toy channel criterion: channel i scores n - i, so the last channels go."""

    @torch.no_grad()
    def __call__(self, group, **kwargs):
        _, idxs = group[0]
        return torch.arange(len(idxs), 0, -1, dtype=torch.float32)


def test_a_registered_channel_criterion_decides_what_goes():
    from sparsekit.prune.channels import CHANNEL_CRITERIA
    from sparsekit.run.config import ChannelConfig, ConfigError

    sk.register_channel_criterion("keep_first", _KeepFirst)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        ref = copy.deepcopy(model)
        sk.prune_channels_(model, torch.randn(2, 16), ratio=0.5, criterion="keep_first",
                           round_to=1)
        # the reference: the first 16 of 32 hidden units kept, in order
        assert torch.equal(model[0].weight, ref[0].weight[:16])
        assert torch.equal(model[0].bias, ref[0].bias[:16])
        assert torch.equal(model[2].weight, ref[2].weight[:, :16])
        # the command line's config takes the registered name; an unknown one names them all
        assert ChannelConfig(criterion="keep_first").criterion == "keep_first"
        with pytest.raises(ConfigError, match=r"prune\.channel\.criterion='nope' is not allowed; "
                                              r"choose one of: magnitude, taylor, lamp, "
                                              r"keep_first"):
            ChannelConfig(criterion="nope")
        with pytest.raises(UsageError, match=r"criterion='nope' is not allowed; choose one of: "
                                             r"magnitude, taylor, lamp, keep_first"):
            sk.prune_channels_(nn.Sequential(nn.Linear(8, 8)), torch.randn(1, 8), ratio=0.5,
                               criterion="nope")
    finally:
        CHANNEL_CRITERIA.unregister("keep_first")


def test_a_channel_criterion_that_needs_gradients_needs_loss_fn():
    from sparsekit.errors import ConfigTypeError
    from sparsekit.prune.channels import CHANNEL_CRITERIA

    sk.register_channel_criterion("grad_toy", _KeepFirst, needs_loss=True)
    try:
        with pytest.raises(UsageError, match=r"criterion='grad_toy' scores channels with "
                                             r"gradients .* needs loss_fn="):
            sk.prune_channels_(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)),
                               torch.randn(1, 8), ratio=0.5, criterion="grad_toy")
    finally:
        CHANNEL_CRITERIA.unregister("grad_toy")
    with pytest.raises(ConfigTypeError, match="make must be callable"):
        sk.register_channel_criterion("bad", 3)

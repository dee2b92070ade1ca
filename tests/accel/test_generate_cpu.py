"""sparsekit's own generate loop (sparsekit/accel/generate.py, decoding.py, sampling.py) on CPU,
against Hugging Face's ``generate`` of the same 2:4-masked tiny Llama, Qwen2 and Mistral:
greedy tokens equal (float32 and bfloat16, batches with left padding, every greedy option);
sampling teacher-forced (HF's sampled tokens fed to sparsekit's loop, whose processed scores
at every step must be HF's ``output_scores``), and with one seed the same draws; every
unsupported option and bad input a one-line error naming it."""

import pytest
import torch

import sparsekit as sk
from sparsekit import _compat
from sparsekit.accel import decoding, graphs, sampling
from sparsekit.accel.generate import Generator

transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "qwen2", "mistral")
VOCAB = 128


def _model(arch: str = "llama", dtype=torch.float32, max_positions: int = 128):
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=max_positions)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    elif arch == "qwen2":  # q/k/v with biases; HF's defaults: no eos id
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    else:  # a sliding window shorter than prompt + new tokens
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=12,
                                                                           **shape))
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["lm_head"])
    return model.eval().to(dtype)


def _ids(batch=2, length=7, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _left_padded():
    """Three prompts of 7, 4 and 1 tokens, left-padded with id 0, and their mask."""
    ids = _ids(3, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _hf(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, **kw)


def _assert_greedy_equal(model, got, want, mask=None):
    """Greedy sequences equal; in bfloat16, a row may part where the model's two candidate
    tokens' logits are within bf16 rounding of each other (a tie), after which it is not
    compared."""
    if torch.equal(got, want):
        return
    assert got.shape == want.shape and model.dtype == torch.bfloat16, (got, want)
    for row in (got != want).any(1).nonzero()[:, 0].tolist():
        at = int((got[row] != want[row]).nonzero()[0])
        prefix = want[row:row + 1, :at]
        kw = {} if mask is None else {"attention_mask": torch.cat(
            [mask[row:row + 1], mask.new_ones((1, at - mask.shape[1]))], 1)}
        with torch.no_grad():
            logits = model(prefix, **kw).logits[0, -1].float()
        a, b = logits[got[row, at]], logits[want[row, at]]
        assert (a - b).abs() <= 4 * 2**-8 * max(a.abs(), b.abs(), 1.0), (row, at, a, b)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_hf_with_left_padding(arch, dtype):
    model = _model(arch, dtype)
    gen = Generator(model, torch.device("cpu"), compile=False)
    ids, mask = _left_padded()
    for kw in ({}, {"attention_mask": mask}):
        x = _ids(3, 7) if not kw else ids
        want = _hf(model, x, max_new_tokens=9, do_sample=False, pad_token_id=0, **kw)
        got = gen.generate(x, max_new_tokens=9, pad_token_id=0, **kw)
        _assert_greedy_equal(model, got, want, kw.get("attention_mask"))
    # alone, each padded prompt generates what it does in the batch
    # (a row alone stops at its end-of-sequence token; in the batch it then gets pad ids)
    got = gen.generate(ids, attention_mask=mask, max_new_tokens=9, pad_token_id=0)
    for row in range(3 if dtype == torch.float32 else 0):
        n = int(mask[row].sum())
        alone = gen.generate(ids[row:row + 1, 7 - n:], max_new_tokens=9, pad_token_id=0)
        assert torch.equal(alone[0, n:], got[row, 7:7 + alone.shape[1] - n])


GREEDY_OPTIONS = [
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 0.7, "attention_mask": True},  # < 1: repeats rewarded
    {"eos_token_id": "first", "pad_token_id": 1},  # ends early: stops, pads the ended row
    {"eos_token_id": "first", "min_new_tokens": 6},  # barred until 6 are new
    {"eos_token_id": ["first", 5, 9]},  # several stop tokens; pad: the first of them
    {"max_length": 12},  # prompt included
    {"max_length": 8},  # one new token: the prefill's, no decode step
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("options", GREEDY_OPTIONS, ids=lambda o: "-".join(o))
def test_greedy_options_equal_hf(arch, options):
    model = _model(arch)
    gen = Generator(model, torch.device("cpu"), compile=False)
    ids, mask = _left_padded()
    free = _hf(model, ids, attention_mask=mask, max_new_tokens=9, do_sample=False,
               pad_token_id=0, eos_token_id=VOCAB - 1)
    first = int(free[0, 7 + 1])  # row 0's second new token: a stop token that occurs
    kw = {}
    for key, value in options.items():
        if key == "attention_mask":
            value = mask
        elif key == "eos_token_id":
            value = [first if v == "first" else v for v in value] if isinstance(value, list) \
                else first
        kw[key] = value
    kw.setdefault("attention_mask", mask)
    if "max_length" not in kw:
        kw["max_new_tokens"] = 9
    if "eos_token_id" not in kw:
        kw["pad_token_id"] = 0  # else: HF's default, the first end-of-sequence id
    want = _hf(model, ids, do_sample=False, **kw)
    got = gen.generate(ids, **kw)
    assert torch.equal(got, want)
    if "eos_token_id" in kw and "min_new_tokens" not in kw:  # row 0 ended at its 2nd token
        assert (got[0, 7 + 2:] == kw.get("pad_token_id", first)).all()


SAMPLING_OPTIONS = [
    {},  # HF's defaults: top_k 50
    {"temperature": 0.6, "top_k": 0},
    {"top_k": 5},
    {"top_p": 0.8, "top_k": 0},
    {"temperature": 1.4, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3},
    {"top_p": 0.7, "eos_token_id": [4, 7, 11], "min_new_tokens": 3},
]


def _teacher_forced(monkeypatch, gen, model, ids, mask, seed, options):
    """HF's sampled sequences (seed ``seed``) and their processed scores per step; sparsekit's
    loop fed HF's tokens (its pick replaced), its sequences and its scores per step."""
    torch.manual_seed(seed)
    hf = _hf(model, ids, attention_mask=mask, max_new_tokens=10, do_sample=True,
             return_dict_in_generate=True, output_scores=True, **options)
    forced = hf.sequences[:, ids.shape[1]:]
    seen = []

    def pick(scores, do_sample, generator=None):
        assert do_sample
        seen.append(scores.clone())
        t = len(seen) - 1  # past HF's end (the lagged stop check's extra steps): padding
        return forced[:, t] if t < forced.shape[1] else torch.zeros_like(forced[:, 0])

    monkeypatch.setattr(sampling, "pick", pick)
    got = gen.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, **options)
    monkeypatch.undo()
    return hf, got, seen


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("options", SAMPLING_OPTIONS, ids=lambda o: "-".join(o) or "defaults")
def test_sampling_teacher_forced_scores_equal_hf(arch, options, monkeypatch):
    model = _model(arch)
    gen = Generator(model, torch.device("cpu"), compile=False)
    ids, mask = _left_padded()
    options = {"pad_token_id": 0, **options}
    hf, got, seen = _teacher_forced(monkeypatch, gen, model, ids, mask, 3, options)
    assert torch.equal(got, hf.sequences)
    assert len(seen) >= len(hf.scores)
    for t, (mine, theirs) in enumerate(zip(seen, hf.scores)):
        assert torch.equal(mine.isinf(), theirs.isinf()), f"step {t}: other tokens filtered"
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    if options.get("top_k") == 5:  # a filter took place
        assert all((s > float("-inf")).sum(-1).le(5).all() for s in seen)
    # one seed, HF's draws: the same tokens (both draw torch.multinomial from torch's RNG)
    torch.manual_seed(3)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=10,
                                    do_sample=True, **options), hf.sequences)


def test_generator_draws_are_its_own():
    model = _model()
    gen = Generator(model, torch.device("cpu"), compile=False)
    ids = _ids()
    runs = [gen.generate(ids, max_new_tokens=12, do_sample=True, top_k=0,
                         generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    torch.manual_seed(0)
    state = torch.get_rng_state()
    gen.generate(ids, max_new_tokens=4, do_sample=True,
                 generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), state)  # the global generator untouched


def test_model_generation_config_is_used_as_hf_uses_it():
    """Options the call leaves unset come from model.generation_config (then HF's defaults)."""
    model = _model()
    gen = Generator(model, torch.device("cpu"), compile=False)
    ids = _ids()
    model.generation_config.repetition_penalty = 1.6
    model.generation_config.max_new_tokens = 6
    model.generation_config.pad_token_id = 0
    want = _hf(model, ids)
    got = gen.generate(ids)
    assert torch.equal(got, want) and got.shape[1] == 7 + 6


def test_accelerated_model_generates_hf_tokens_without_hf_generate(monkeypatch):
    """fast.generate on an accelerated model (CPU reference kernels, compiled with the eager
    backend): HF's greedy and teacher-forced sampled tokens for left-padded prompts, and
    HF's own generate never called."""
    model = _model("llama", torch.bfloat16)
    ref = _model("llama", torch.bfloat16)
    ids, mask = _left_padded()
    fast = sk.accelerate(model, {"input_ids": ids, "attention_mask": mask}, device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    want = _hf(ref, ids, attention_mask=mask, max_new_tokens=9, do_sample=False,
               pad_token_id=0, repetition_penalty=1.2)

    def refuse(*a, **kw):
        raise AssertionError("HF's generate called")

    monkeypatch.setattr(type(model), "generate", refuse)
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=9, pad_token_id=0,
                        repetition_penalty=1.2)
    _assert_greedy_equal(ref, got, want, mask)
    with pytest.raises(ValueError, match="num_beams"):
        fast.generate(ids, num_beams=2)


def _message(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text.startswith("generate: ")
    return text


UNSUPPORTED = [
    ("num_beams", 4), ("num_beams", True), ("num_return_sequences", 2),
    ("return_dict_in_generate", True), ("return_dict_in_generate", 1), ("output_scores", True),
    ("output_logits", True), ("use_cache", False), ("use_cache", 1), ("streamer", object()),
    ("no_repeat_ngram_size", 2), ("min_p", 0.1), ("past_key_values", object()),
    ("cache_implementation", "static"), ("assistant_model", object()), ("typo_option", 3),
]


@pytest.mark.parametrize("name,value", UNSUPPORTED, ids=[f"{n}={v!r}"[:30] for n, v in
                                                          UNSUPPORTED])
def test_unsupported_option_is_a_one_line_error(name, value):
    gen = Generator(_model(), torch.device("cpu"), compile=False)
    with pytest.raises(ValueError) as e:
        gen.generate(_ids(), max_new_tokens=2, **{name: value})
    text = _message(e)
    assert name in text and "max_new_tokens" in text and "top_p" in text  # what it takes


def test_neutral_values_of_hf_options_are_accepted():
    model = _model()
    gen = Generator(model, torch.device("cpu"), compile=False)
    ids = _ids()
    plain = gen.generate(ids, max_new_tokens=3)
    same = gen.generate(ids, max_new_tokens=3, num_beams=1, num_return_sequences=1,
                        use_cache=True, return_dict_in_generate=False, output_scores=False)
    assert torch.equal(plain, same)
    model.generation_config.num_beams = 3
    with pytest.raises(ValueError, match="generation_config sets num_beams=3") as e:
        gen.generate(ids, max_new_tokens=3)
    _message(e)
    assert torch.equal(gen.generate(ids, max_new_tokens=3, num_beams=1), plain)


BAD_OPTIONS = [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": -3}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": 10**9}, ValueError, "max_position_embeddings"),
    ({"max_new_tokens": 122}, ValueError, "at most 121 new tokens"),
    ({"max_length": 5}, ValueError, "max_length=5 leaves no new token"),
    ({"do_sample": 1}, TypeError, "do_sample"),
    ({"do_sample": True, "temperature": 0.0}, ValueError, "temperature"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"top_k": -1}, ValueError, "top_k"),
    ({"top_k": 2.5}, TypeError, "top_k"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"repetition_penalty": 0}, ValueError, "repetition_penalty"),
    ({"min_new_tokens": -1}, ValueError, "min_new_tokens"),
    ({"eos_token_id": VOCAB}, ValueError, "eos_token_id"),
    ({"eos_token_id": [2, "x"]}, ValueError, "eos_token_id"),
    ({"pad_token_id": -1}, ValueError, "pad_token_id"),
    ({"generator": 5}, TypeError, "generator"),
]


@pytest.mark.parametrize("options,error,match", BAD_OPTIONS,
                         ids=[str(o)[:40] for o, _, _ in BAD_OPTIONS])
def test_bad_option_value_is_a_one_line_error(options, error, match):
    gen = Generator(_model(), torch.device("cpu"), compile=False)
    kw = {"max_new_tokens": 2, **options}
    if "max_length" in options:
        del kw["max_new_tokens"]
    with pytest.raises(error, match=match) as e:
        gen.generate(_ids(), **kw)
    _message(e)


def _bad_inputs():
    ids = _ids()
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    empty_row = torch.ones_like(ids)
    empty_row[1] = 0
    return [
        (ids.float(), None, TypeError, "integer token ids"),
        (ids.bool(), None, TypeError, "integer token ids"),
        (ids.tolist(), None, TypeError, "2-D tensor"),
        (ids.clone().fill_(VOCAB), None, ValueError, r"0\.\.127"),
        (ids.index_fill(1, torch.tensor([3]), -1), None, ValueError, r"-1\.\."),
        (ids[:, :0], None, ValueError, "empty"),
        (ids[:0], None, ValueError, "empty"),
        (ids[0], None, ValueError, r"2-D .*input_ids\[None\]"),
        (ids[None], None, ValueError, "2-D"),
        (ids, torch.ones(2, 6, dtype=torch.long), ValueError, "input_ids' shape"),
        (ids, torch.ones(2, 7) * 2, ValueError, "only 0s"),
        (ids, right, ValueError, "left padding"),
        (ids, empty_row, ValueError, "row 1 is all 0s"),
        (ids, [[1] * 7] * 2, TypeError, "attention_mask"),
    ]


@pytest.mark.parametrize("ids,mask,error,match", _bad_inputs(),
                         ids=[m for *_, m in _bad_inputs()])
def test_bad_input_is_a_one_line_error(ids, mask, error, match):
    gen = Generator(_model(), torch.device("cpu"), compile=False)
    with pytest.raises(error, match=match) as e:
        gen.generate(ids, attention_mask=mask, max_new_tokens=2)
    _message(e)


def test_prompt_filling_the_model_positions_is_a_one_line_error():
    gen = Generator(_model(max_positions=16), torch.device("cpu"), compile=False)
    with pytest.raises(ValueError, match="the prompt alone fills it") as e:
        gen.generate(_ids(1, 16), max_new_tokens=1)
    _message(e)
    assert gen.generate(_ids(1, 15), max_new_tokens=1).shape == (1, 16)


def test_decoding_resolve_defaults_and_generation_config():
    d = decoding.resolve(None, {}, vocab=VOCAB)
    assert (d.max_new_tokens, d.max_length, d.do_sample, d.top_k, d.eos, d.pad) == \
        (None, 20, False, 50, (), None)
    assert d.new_tokens(7) == 13
    cfg = transformers.GenerationConfig(eos_token_id=[3, 4], top_k=7, do_sample=True)
    d = decoding.resolve(cfg, {"top_k": 9}, vocab=VOCAB)
    assert (d.top_k, d.eos, d.pad, d.do_sample) == (9, (3, 4), 3, True)  # pad: the first eos


class _ReplayedCall:
    """Stands in for graphs.CapturedCall on CPU as a CUDA graph behaves: the capture runs
    nothing (the cache's counters do not move), a replay runs the call on the static inputs
    (the call's tensors copied in) and writes its output into the one output object every
    replay returns."""

    def __init__(self, fn, args, kwargs, pool):
        from sparsekit.nn.calibration import tree_map

        self.fn, self.static, self.inputs, self.out = fn, tree_map(torch.clone, (args, kwargs)),\
            [], None
        graphs.input_key(self.static, self.inputs)

    def __call__(self, tensors):
        for dst, src in zip(self.inputs, tensors):
            dst.copy_(src)
        out = self.fn(*self.static[0], **self.static[1])
        if self.out is None:
            self.out = out
        else:
            self.out.logits.copy_(out.logits)
        return self.out


def test_graph_replay_path_gives_hf_tokens(monkeypatch):
    """The CUDA path's logic on CPU (graphs replaced by :class:`_ReplayedCall`, streams by
    no-ops, sparsekit's decode attention's CPU reference switched on): warm-ups that advance
    the cache, reset, replays that overwrite one output: HF's tokens, one graph per kind,
    replayed by the next call, and the model's attention implementation put back."""
    import contextlib

    from sparsekit.accel import generate
    from sparsekit.accel.kernels.attention import decode

    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(graphs, "CapturedCall", _ReplayedCall)
    monkeypatch.setattr(_compat, "clear_cublas_workspaces", lambda: None)
    monkeypatch.setattr(generate, "attention_for", lambda model, device: decode.register())
    model = _model("llama", torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    gen = Generator(model, torch.device("cpu"), compile=False)
    gen.capture = True  # as on CUDA
    ids, mask = _left_padded()
    want = _hf(model, ids, attention_mask=mask, max_new_tokens=9, do_sample=False,
               pad_token_id=0, eos_token_id=[2, 5])
    for _ in range(2):  # the second call replays the first's graphs
        got = gen.generate(ids, attention_mask=mask, max_new_tokens=9, pad_token_id=0,
                           eos_token_id=[2, 5])
        _assert_greedy_equal(model, got, want, mask)
        assert model.config._attn_implementation == "sdpa"
    assert sorted(kind for _, kind in gen.graphs) == ["decode", "prefill"]
    assert all(len(g.graphs) == 1 for g in gen.graphs.values())


def test_generation_config_argument_sits_between_the_call_and_the_models():
    model = _model()
    gen = Generator(model, torch.device("cpu"), compile=False)
    ids = _ids()
    model.generation_config.repetition_penalty = 1.6  # under the call's config
    given = transformers.GenerationConfig(max_new_tokens=5, repetition_penalty=0.8,
                                          pad_token_id=0)
    want = _hf(model, ids, generation_config=given, top_k=3)
    got = gen.generate(ids, generation_config=given, top_k=3)
    assert torch.equal(got, want) and got.shape[1] == 7 + 5
    with pytest.raises(TypeError, match="GenerationConfig") as e:
        gen.generate(ids, generation_config={"max_new_tokens": 2})
    _message(e)
    with pytest.raises(ValueError, match=r"generation_config sets num_beams=2") as e:
        gen.generate(ids, generation_config=transformers.GenerationConfig(num_beams=2))
    _message(e)
    # a bad value a config gave: the error says where it came from
    model.generation_config.pad_token_id = -1
    with pytest.raises(ValueError, match=r"pad_token_id \(from model.generation_config\)"):
        gen.generate(ids, max_new_tokens=2)


def test_seen_tokens_ignores_padding_even_for_a_token_also_in_the_prompt():
    ids = torch.tensor([[5, 7, 5, 9], [5, 5, 6, 6]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    seen = sampling.seen_tokens(ids, mask, vocab=10)
    assert seen.nonzero().tolist() == [[0, 5], [0, 9], [1, 5], [1, 6]]  # 7: padding only


@pytest.mark.parametrize("seed", range(4))
def test_processing_equals_hfs_processor_chain_on_random_scores(seed):
    """sampling.process against HF's own processors (public classes), on random scores with
    repeated values (ties at the top-k and top-p edges) and a random seen set."""
    from transformers.generation import logits_process as lp

    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-8, 8, (3, 40), generator=g).float() / 4  # many ties
    ids = torch.randint(0, 40, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    k, p, t, r = 1 + seed * 3, 0.3 + 0.2 * seed, 0.5 + 0.4 * seed, 1.1 + 0.3 * seed
    chain = lp.LogitsProcessorList([
        lp.RepetitionPenaltyLogitsProcessor(r),
        lp.MinNewTokensLengthLogitsProcessor(6, 2, [3, 4]),
        lp.TemperatureLogitsWarper(t), lp.TopKLogitsWarper(k), lp.TopPLogitsWarper(p)])
    bar = torch.zeros(40, dtype=torch.bool)
    bar[[3, 4]] = True
    mine = sampling.process(scores, seen=sampling.seen_tokens(ids, mask, 40), penalty=r,
                            bar_eos=bar, do_sample=True, temperature=t, k=k, p=p)
    torch.testing.assert_close(mine, chain(ids, scores.clone()), rtol=0, atol=0)

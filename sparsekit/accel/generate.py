"""sparsekit's own token generation for a Hugging Face causal LM: a prefill, then one decode
step per new token, over a static KV cache, the loop gpt-fast's (``prefill`` +
``decode_n_tokens``), the model called through its public forward with HF's ``StaticCache``
(no patch of HF's ``generate``, its classes or its configs).

- prefill (a prompt of L tokens): the prompt is left-padded to a bucket (a power of two, at
  least 16) with its attention mask zero there, so every prompt length in a bucket runs one
  compiled graph; the 2:4 layers see M = batch x bucket rows (the large-M kernels); only the
  last position's logits are computed;
- decode (one token per sequence): M = batch rows, the small-M kernels
  (:mod:`sparsekit.accel.kernels.triton24.format`).

Both run one ``torch.compile``d forward (its graph per input shape); on CUDA each shape is
replayed as sparsekit's own CUDA graph (:class:`~sparsekit.accel.graphs.GraphCache`; torch's
CUDA-graph trees skip graphs whose inputs are mutated, as the cache's position counters are).
Every step's inputs have fixed shapes: the attention mask spans the whole cache (the causal
mask hides the positions not yet written), positions are per sequence (left padding). The
cache is sparsekit's, one per (batch, length), reset between calls, so its tensors keep their
addresses and the graphs stay valid. Compiles are counted in the model's report
(``report.compiles``): one per prefill bucket and one per batch size for decode. The host
seconds of the calls that built a graph (compiled, warmed up and captured it) add up per kind
in ``report.seconds`` (``generate_prefill``, ``generate_decode``).

The next token is chosen as HF's ``generate`` chooses it (:mod:`sparsekit.accel.sampling`,
options as :mod:`sparsekit.accel.decoding` resolves them): greedy or sampled, temperature,
top-k, top-p, repetition penalty, ``min_new_tokens``, end-of-sequence ids (finished sequences
get the pad id). Whether every sequence has finished is read a few steps late
(:class:`~sparsekit.accel.lagged_stop.LaggedStopCheck`), so the host queues the next steps
while the GPU runs; the sequences returned are those of a per-step check.

On CUDA, a model on HF's SDPA attention runs its decode steps' attention on sparsekit's
kernel (:mod:`sparsekit.accel.kernels.attention.decode`: grouped-query heads read once,
unfilled cache positions skipped) for the duration of each generate call (HF's public
``set_attn_implementation``); ``PlanOptions(decode_attention=False)`` keeps HF's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.accel import decoding, graphs, lagged_stop, sampling
from sparsekit.accel.kernels.attention import decode as attention

log = logging.getLogger(__name__)

MIN_BUCKET = 16
MIN_CACHE = 256


def bucket(length: int) -> int:
    """The prompt length a prompt of ``length`` tokens is padded to: the next power of two,
    at least 16."""
    return max(MIN_BUCKET, 1 << max(0, length - 1).bit_length())


def cache_length(prompt_bucket: int, max_new_tokens: int) -> int:
    """The static cache's length: the next power of two holding the padded prompt and the new
    tokens, at least 256 (few distinct lengths: each one is a new cache and new graphs)."""
    need = prompt_bucket + max_new_tokens
    return max(MIN_CACHE, 1 << (need - 1).bit_length())


def check_generates(model: nn.Module) -> None:
    """TypeError unless ``model`` is a Hugging Face model with ``generate`` (a causal LM)."""
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "config"):
        raise TypeError(f"generate() needs a Hugging Face model with a generate method (a "
                        f"causal LM such as LlamaForCausalLM), got {type(model).__name__}")


def _text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def vocab_size(model: nn.Module) -> int:
    """The number of token ids ``model`` embeds."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embed, nn.Embedding):
        return embed.num_embeddings
    return int(_text_config(model).vocab_size)


class Generator:
    """The runners and caches behind :meth:`AcceleratedModel.generate` for one model (any
    Hugging Face causal LM: ``compile=False`` runs its forward as it is)."""

    def __init__(self, model: nn.Module, device: torch.device, *, compile: bool,
                 backend: str = "inductor", count: Callable[[int], None] = lambda n: None,
                 notes: list[str] | None = None, inductor: dict | None = None,
                 seconds: dict[str, float] | None = None):
        check_generates(model)
        self.model = model
        self.device = device
        self.count = count
        self.caches: dict[tuple[int, int], Any] = {}
        forward = type(model).forward.__get__(model)
        params = inspect.signature(forward).parameters
        # transformers >= 5.2x names the forward's cache argument ``cache``
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params  # transformers 4.x
        # the prefill asks for the last position's logits only
        self.last_logits = "logits_to_keep" in params
        self.vocab = vocab_size(model)
        self.max_positions = getattr(_text_config(model), "max_position_embeddings", None)
        # one compiled forward: prefill and decode are its graphs for their input shapes; the
        # model's inductor options (siblings' MergeSameCalls pass: without it each member of a
        # fused group would run the group's whole GEMM)
        self.run = _compat.compile_module(forward, dynamic=False, backend=backend,
                                          options=inductor) if compile else forward
        self.compiled = compile
        self.capture = compile and device.type == "cuda"
        self.graphs: dict[tuple[int, str], graphs.GraphCache] = {}
        self.notes = [] if notes is None else notes
        self.seconds = {} if seconds is None else seconds  # report.seconds: graph-building calls
        self.attention = attention_for(model, device)
        if self.attention is not None:
            self.notes.append("generate: decode attention on sparsekit's kernel (grouped-query "
                              "heads read once, unfilled cache positions skipped)")

    def _cache(self, batch: int, length: int) -> Any:
        from transformers import StaticCache

        key = (batch, length)
        cache = self.caches.get(key)
        if cache is None:
            cache = StaticCache(config=self.model.config, max_cache_len=length)
            _allocate(cache, self.model, batch, self.device)
            self.caches[key] = cache
        else:
            cache.reset()
        return cache

    def _replay(self, kind: str, cache: Any, kwargs: dict) -> Any:
        """``run(**kwargs)`` on ``cache`` from its CUDA graph, or None when the call cannot be
        captured. A new signature is warmed up and captured, which runs the model (warm-up)
        and so advances the cache's position counters: they are put back before each warm-up
        and before the first replay (``GraphCache(reset=...)``)."""
        gc = self.graphs.get((id(cache), kind))
        if gc is None:
            def bound(**kw):
                return self.run(**{self.cache_arg: cache}, **kw)
            gc = self.graphs[(id(cache), kind)] = graphs.GraphCache(bound)
        found: list[torch.Tensor] = []
        key = graphs.input_key(((), kwargs), found)
        if key is None:
            return None
        if key in gc.graphs:
            return gc.graphs[key](found)
        if not all(getattr(layer, "is_initialized", True) for layer in getattr(cache, "layers",
                                                                                ())):
            # the cache allocates its tensors (and counters) on its first update: that call
            # runs compiled, uncaptured, so the counters exist before any capture saves them
            return None
        state = _small_state(cache)

        def reset() -> None:
            for dst, src in state:
                dst.copy_(src)

        gc.reset = reset
        before, t0 = gc.compiled, time.perf_counter()
        out = gc.run((), kwargs)  # a new signature: compiled if new, warmed up, captured
        self._spent(kind, t0)
        self.count(gc.compiled - before)
        if out is None:
            reset()
            self.notes.append(f"generate: {kind} not captured ({gc.why}); compiled only")
        return out

    def _forward(self, kind: str, cache: Any, **kwargs: Any) -> torch.Tensor:
        """The last position's logits (batch, vocab) of one prefill or decode call on
        ``cache``: its CUDA graph on CUDA, else the compiled (or plain) forward."""
        out = self._replay(kind, cache, kwargs) if self.capture else None
        if out is None:
            before = _compat.compiled_graph_count() if self.compiled else 0
            t0 = time.perf_counter()
            out = self.run(**{self.cache_arg: cache}, **kwargs)
            if self.compiled:
                new = _compat.compiled_graph_count() - before
                if new:
                    self._spent(kind, t0)
                self.count(new)
        return out.logits[:, -1]

    @contextlib.contextmanager
    def _attention(self):
        """The model on sparsekit's decode attention for the call (when it has one)."""
        if self.attention is None:
            yield
            return
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.attention)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    def _spent(self, kind: str, t0: float) -> None:
        """Add the seconds since ``t0`` (a call that built a ``kind`` graph) to the report."""
        key = f"generate_{kind}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Generate from ``input_ids`` (batch, tokens) with Hugging Face's keyword arguments
        (:data:`sparsekit.accel.decoding.SUPPORTED`); returns the sequences, prompt included,
        as ``model.generate`` does: (batch, tokens + new), shorter when every sequence ended
        early."""
        opts = decoding.resolve(getattr(self.model, "generation_config", None), kwargs,
                                self.vocab)
        mask = decoding.check_inputs(input_ids, kwargs.get("attention_mask"), self.vocab)
        batch, length = input_ids.shape
        new = opts.new_tokens(length)
        limit = self.max_positions
        if limit is not None and length + new > limit:
            room = (f"at most {limit - length} new tokens" if length < limit else
                    "the prompt alone fills it")
            raise ValueError(f"generate: a prompt of {length} tokens and max_new_tokens={new} "
                             f"pass the model's max_position_embeddings ({limit}): {room}")
        if opts.generator is not None and opts.generator.device.type != self.device.type:
            raise ValueError(f"generate: generator is on {opts.generator.device}, the model on "
                             f"{self.device}: make it with torch.Generator(device=...)")
        with torch.no_grad(), self._attention(), _compat.recompile_limit():
            return self._loop(input_ids.to(self.device, torch.long), mask.to(self.device),
                              new, opts)

    def _loop(self, ids: torch.Tensor, mask: torch.Tensor, new: int,
              opts: decoding.Decoding) -> torch.Tensor:
        """Prefill, then ``new`` - 1 decode steps (gpt-fast's loop); see :meth:`generate`."""
        batch, length = ids.shape
        padded = bucket(length)
        pad = padded - length
        size = cache_length(padded, new)
        cache = self._cache(batch, size)
        device = self.device
        # the mask over the whole cache: the bucket's padding, the prompt's, every later token
        full = torch.cat([mask.new_zeros((batch, pad)), mask,
                          mask.new_ones((batch, size - padded))], 1)
        prompt_mask = full[:, :padded]
        positions = (prompt_mask.cumsum(-1) - 1).clamp_(min=0)
        prompt = torch.cat([ids.new_full((batch, pad), opts.pad or 0), ids], 1)
        tokens = torch.empty((batch, padded + new), dtype=torch.long, device=device)
        tokens[:, :padded] = prompt
        step = {"attention_mask": full, "use_cache": True}
        first = dict(step, input_ids=prompt, position_ids=positions)
        if self.last_logits:
            first["logits_to_keep"] = 1
        if self.cache_position:
            first["cache_position"] = torch.arange(padded, device=device)
        logits = self._forward("prefill", cache, **first)
        position = positions[:, -1:] + 1
        choose = sampling.NextToken(opts, prompt, prompt_mask, logits.shape[-1])
        stop = None
        if opts.eos:
            stop = lagged_stop.LaggedStopCheck(padded + new,
                                               lagged_stop.LAG if lagged_stop.enabled() else 0)
        steps = new
        for t in range(new):
            token = choose(logits, t)
            tokens[:, padded + t] = token
            if stop is not None and stop(choose.unfinished, token, padded + t + 1):
                steps = t + 1 - stop.finish()
                break
            if t + 1 < new:
                inputs = dict(step, input_ids=token[:, None], position_ids=position + t)
                if self.cache_position:
                    inputs["cache_position"] = torch.arange(padded + t, padded + t + 1,
                                                            device=device)
                logits = self._forward("decode", cache, **inputs)
        return tokens[:, pad:padded + steps].clone()

def attention_for(model: nn.Module, device: torch.device) -> str | None:
    """The attention implementation generate switches ``model`` to: sparsekit's
    (:data:`sparsekit.accel.kernels.attention.decode.NAME`) for a model on HF's SDPA on CUDA,
    unless ``PlanOptions(decode_attention=False)``; else None (the model's own)."""
    if device.type != "cuda" or not attention.enabled():
        return None
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return None
    try:
        return attention.register()
    except (ImportError, AttributeError) as e:  # a transformers without the interfaces
        log.info("generate: HF's attention kept (%s)", e)
        return None


def _allocate(cache: Any, model: nn.Module, batch: int, device: torch.device) -> None:
    """Allocate the cache's layers now (HF allocates them on their first update otherwise):
    the first prefill then sees the same cache as every later one (one compile per shape, and
    it can be captured)."""
    if not hasattr(cache, "early_initialization"):
        return
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else \
        model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                 torch.bfloat16)
    try:
        cache.early_initialization(batch, heads, head_dim, dtype, device)
    except (TypeError, ValueError) as e:  # a cache layout this does not know: allocate lazily
        log.info("generate: the static cache is allocated on its first use (%s)", e)


def _small_state(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, copy) of the cache layers' small tensors (position counters; not the KV)."""
    out = []
    for layer in getattr(cache, "layers", ()):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) and value.numel() <= 64:
                out.append((value, value.clone()))
    return out


__all__ = ["Generator", "attention_for", "bucket", "cache_length", "check_generates"]

"""Token generation on an accelerated Hugging Face causal LM: HF's own ``generate()`` (greedy,
sampling, its logits processors and stopping criteria), with the model's forward routed to two
compiled runners over one static KV cache:

- prefill (a prompt of L tokens): the prompt is left-padded to a bucket (a power of two, at
  least 16) with its attention mask zero there, so every prompt length in a bucket runs one
  compiled graph; the 2:4 layers see M = batch x bucket rows (the large-M kernels);
- decode (one token per sequence): M = batch rows, the small-M kernels
  (:mod:`sparsekit.accel.kernels.triton24.format`).

Both are ``torch.compile``d; on CUDA each is replayed as sparsekit's own CUDA graph per input
signature and cache (:class:`~sparsekit.accel.graphs.GraphCache`; torch's CUDA-graph trees skip
graphs whose inputs are mutated, as the cache's position counters are). The cache is
sparsekit's, one per (batch, length), reset between calls, so its tensors keep their addresses
and the graphs stay valid; the prefill computes the logits of the last position only.
Compiles are counted in the model's report (``report.compiles``): one per prefill bucket and
one per batch size for decode (the cache's layers are allocated before its first use, so its
second use compiles nothing new), and a prompt that fills its bucket exactly runs without a
mask: one more graph for that length. The host seconds of the calls that built a graph
(compiled, warmed up and captured it) add up per kind in ``report.seconds``
(``generate_prefill``, ``generate_decode``): where a first generate's time goes.

HF's loop checks after each token whether every sequence has finished, which makes the host
wait for the GPU every step; here that check is read a few steps late
(:mod:`sparsekit.accel.lagged_stop`), so the host queues the next steps while the GPU runs,
with the same returned sequences.

On CUDA, a model on HF's SDPA attention runs its decode steps' attention on sparsekit's
kernel (:mod:`sparsekit.accel.kernels.attention.decode`: grouped-query heads read once,
unfilled cache
positions skipped) for the duration of each generate call; ``SPARSEKIT_DECODE_ATTENTION=0``
keeps HF's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.accel import graphs, lagged_stop
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


class Generator:
    """The runners and caches behind :meth:`AcceleratedModel.generate` for one model."""

    def __init__(self, model: nn.Module, device: torch.device, *, compile: bool,
                 backend: str, count: Callable[[int], None], notes: list[str],
                 inductor: dict | None = None, seconds: dict[str, float] | None = None):
        check_generates(model)
        self.model = model
        self.device = device
        self.count = count
        self.caches: dict[tuple[int, int], Any] = {}
        forward = type(model).forward.__get__(model)
        self.forward = forward
        # generate reads the last position's logits only: the prefill asks for just those
        self.last_logits = "logits_to_keep" in inspect.signature(forward).parameters
        # one compiled forward: prefill and decode are its graphs for their input shapes; the
        # model's inductor options (siblings' MergeSameCalls pass: without it each member of a
        # fused group would run the group's whole GEMM)
        self.run = _compat.compile_module(forward, dynamic=False, backend=backend,
                                          options=inductor) if compile else forward
        self.compiled = compile
        self.capture = compile and device.type == "cuda"
        self.graphs: dict[tuple[int, str], graphs.GraphCache] = {}
        self.notes = notes
        self.seconds = {} if seconds is None else seconds  # report.seconds: graph-building calls
        self.attention = attention_for(model, device)
        if self.attention is not None:
            notes.append("generate: decode attention on sparsekit's kernel (grouped-query "
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

    def _replay(self, kind: str, cache: Any, args: tuple, kwargs: dict) -> Any:
        """``run(*args, past_key_values=cache, **kwargs)`` from its CUDA graph, or None when the
        call cannot be captured. A new signature is warmed up and captured, which runs the model
        (warm-up) and so advances the cache's position counters: they are put back before each
        warm-up and before the first replay (``GraphCache(reset=...)``)."""
        gc = self.graphs.get((id(cache), kind))
        if gc is None:
            def bound(*a, **kw):
                return self.run(*a, past_key_values=cache, **kw)
            gc = self.graphs[(id(cache), kind)] = graphs.GraphCache(bound)
        found: list[torch.Tensor] = []
        key = graphs.input_key((args, kwargs), found)
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
        out = gc.run(args, kwargs)  # a new signature: compiled if new, warmed up, captured
        self._spent(kind, t0)
        self.count(gc.compiled - before)
        if out is None:
            reset()
            self.notes.append(f"generate: {kind} not captured ({gc.why}); compiled only")
        return out

    @contextlib.contextmanager
    def _routed(self, cache: Any):
        """The model's forward routed to the prefill or decode runner for the call."""
        def forward(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs["inputs_embeds"]
            decode = ids.shape[1] == 1
            if not decode and self.last_logits:
                kwargs["logits_to_keep"] = 1
            for name in ("past_key_values", "cache"):
                if kwargs.get(name) is cache:
                    del kwargs[name]
            if self.capture:
                out = self._replay("decode" if decode else "prefill", cache, args, kwargs)
                if out is not None:
                    return out
            before = _compat.compiled_graph_count() if self.compiled else 0
            t0 = time.perf_counter()
            out = self.run(*args, past_key_values=cache, **kwargs)
            if self.compiled:
                new = _compat.compiled_graph_count() - before
                if new:
                    self._spent("decode" if decode else "prefill", t0)
                self.count(new)
            return out

        config = self.model.config
        before = config._attn_implementation
        self.model.forward = forward
        if self.attention is not None:
            config._attn_implementation = self.attention
        try:
            yield
        finally:
            del self.model.forward
            config._attn_implementation = before

    def _spent(self, kind: str, t0: float) -> None:
        """Add the seconds since ``t0`` (a call that built a ``kind`` graph) to the report."""
        key = f"generate_{kind}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, **kwargs: Any) -> torch.Tensor:
        """HF ``generate`` on the routed model; returns the sequences (prompt + new tokens,
        without sparsekit's padding), as ``model.generate`` does."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else \
                type(input_ids).__name__
            raise ValueError(f"generate: input_ids must be a 2-D tensor (batch, tokens), got "
                             f"{got}")
        for key in ("past_key_values", "cache_implementation", "return_dict_in_generate",
                    "num_beams", "assistant_model"):
            if kwargs.get(key) not in (None, False, 1):
                raise ValueError(f"generate: {key}= is not supported on an accelerated model "
                                 f"(it runs its own static cache, greedy or sampling, and "
                                 f"returns the sequences)")
        new = max_new_tokens if max_new_tokens is not None else \
            self.model.generation_config.max_new_tokens
        if not isinstance(new, int) or new < 1:
            raise ValueError(f"generate: max_new_tokens must be a positive int, got {new!r}")
        input_ids = input_ids.to(self.device)
        batch, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device)
        padded = bucket(length)
        pad = padded - length
        if pad:
            pad_id = self._pad_id()
            input_ids = torch.cat([input_ids.new_full((batch, pad), pad_id), input_ids], 1)
            attention_mask = torch.cat([attention_mask.new_zeros((batch, pad)),
                                        attention_mask], 1)
        cache = self._cache(batch, cache_length(padded, new))
        kwargs.setdefault("pad_token_id", self._pad_id())
        with self._routed(cache), torch.no_grad(), warnings.catch_warnings(), \
                lagged_stop.installed(input_ids.shape[1] + new), _compat.recompile_limit():
            # transformers >= 5.2x renamed generate's past_key_values to cache (older: no cache)
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated",
                                    category=FutureWarning)
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=new, past_key_values=cache,
                                      disable_compile=True, **kwargs)
        return out[:, pad:]

    def _pad_id(self) -> int:
        gc = self.model.generation_config
        for pid in (gc.pad_token_id, gc.eos_token_id, getattr(self.model.config, "pad_token_id",
                                                               None)):
            if isinstance(pid, (list, tuple)):
                pid = pid[0] if pid else None
            if pid is not None:
                return int(pid)
        return 0


def attention_for(model: nn.Module, device: torch.device) -> str | None:
    """The attention implementation generate switches ``model`` to: sparsekit's
    (:data:`sparsekit.accel.kernels.attention.decode.NAME`) for a model on HF's SDPA on CUDA, unless
    ``SPARSEKIT_DECODE_ATTENTION=0``; else None (the model's own)."""
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

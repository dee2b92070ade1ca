"""What sparsekit's generate takes: Hugging Face's keyword arguments for greedy and sampled
decoding, resolved as HF resolves them (the call's value, else its ``generation_config``'s,
else ``model.generation_config``'s, else HF's default) into one frozen :class:`Decoding`, and
the prompt's ids and attention mask checked. Anything else is a one-line ``ValueError``
(``TypeError`` for a value of the wrong type) naming the argument and what is supported.

>>> d = resolve(None, {"do_sample": True, "top_p": 0.9}, vocab=100)
>>> (d.do_sample, d.top_k, d.top_p, d.temperature)
(True, 50, 0.9, 1.0)
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

# the keyword arguments generate takes (HF's names; ``generator``: sparsekit's, a
# torch.Generator the draws use, on the model's device)
SUPPORTED = ("attention_mask", "max_new_tokens", "max_length", "min_new_tokens", "do_sample",
             "temperature", "top_k", "top_p", "repetition_penalty", "eos_token_id",
             "pad_token_id", "generation_config", "generator")
# HF arguments taken only at the value that changes nothing (None is HF's "unset" too)
NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True,
           "return_dict_in_generate": False, "output_scores": False, "output_logits": False,
           "output_attentions": False, "output_hidden_states": False}
# generation_config fields that change the tokens or the output, at the values that don't
CONFIG_NEUTRAL = {**NEUTRAL, "min_length": 0, "no_repeat_ngram_size": 0,
                  "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
                  "forced_bos_token_id": None, "forced_eos_token_id": None,
                  "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                  "guidance_scale": 1.0, "min_p": None, "top_h": None, "typical_p": 1.0,
                  "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                  "exponential_decay_length_penalty": None, "penalty_alpha": None,
                  "dola_layers": None, "max_time": None, "stop_strings": None,
                  "watermarking_config": None, "encoder_repetition_penalty": 1.0,
                  "num_beam_groups": 1, "diversity_penalty": 0.0, "low_memory": None}
# HF's defaults for what neither the call nor a generation config sets
DEFAULTS = {"max_length": 20, "min_new_tokens": 0, "do_sample": False, "temperature": 1.0,
            "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
WHAT = ("greedy or sampled decoding, one sequence per prompt, on sparsekit's static cache; "
        "it returns the sequences")


@dataclasses.dataclass(frozen=True)
class Decoding:
    """The resolved options of one generate call. ``max_new_tokens`` is None when the length
    comes from ``max_length`` (prompt included): :meth:`new_tokens` turns it into a count.
    ``eos``: the end-of-sequence ids (empty: none; the loop then never stops early);
    ``pad``: the id of tokens after a sequence's end (HF: ``pad_token_id``, else the first
    end-of-sequence id)."""

    max_new_tokens: int | None
    max_length: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    eos: tuple[int, ...]
    pad: int | None
    generator: torch.Generator | None

    def new_tokens(self, prompt: int) -> int:
        """The number of tokens to generate after a prompt of ``prompt`` tokens."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        new = self.max_length - prompt
        if new < 1:
            raise ValueError(f"generate: max_length={self.max_length} leaves no new token after "
                             f"a prompt of {prompt} tokens; pass max_new_tokens")
        return new


def _config_value(config: Any, name: str) -> Any:
    return getattr(config, name, None) if config is not None else None


def _is_neutral(value: Any, neutral: Any) -> bool:
    """Whether ``value`` is HF's unset (None) or exactly ``neutral`` (types checked: True is
    not 1, 1.0 is not True)."""
    if value is None:
        return True
    if neutral is None:  # off: False or an empty list
        return value is False or (isinstance(value, (list, tuple, dict)) and not value)
    if isinstance(neutral, bool) or isinstance(value, bool):
        return type(value) is bool and value is neutral
    return isinstance(value, numbers.Real) and value == neutral


def check_kwargs(kwargs: dict[str, Any], configs: dict[str, Any]) -> None:
    """ValueError for an argument generate does not take (or takes only at its neutral value),
    or a setting of a generation config (``configs``: by the name errors give it) that it
    cannot honour."""
    for name, value in kwargs.items():
        if name in SUPPORTED:
            continue
        if name in NEUTRAL and _is_neutral(value, NEUTRAL[name]):
            continue
        shown = f"{name}={value!r}" if name in NEUTRAL else f"{name}="
        raise ValueError(f"generate: {shown} is not supported ({WHAT}); it takes "
                         f"{', '.join(SUPPORTED)}"
                         + (f", and {name} only as {NEUTRAL[name]!r}" if name in NEUTRAL else ""))
    for where, config in configs.items():
        for name, neutral in CONFIG_NEUTRAL.items():
            value = _config_value(config, name)
            if name not in kwargs and not _is_neutral(value, neutral):
                raise ValueError(f"generate: {where} sets {name}={value!r}, which sparsekit's "
                                 f"generate does not support ({WHAT}); pass {name}={neutral!r} "
                                 f"or change {where}")


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"generate: {name} must be an int >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"generate: {name} must be an int >= {low}, got {value!r}")
    return int(value)


def _real(name: str, value: Any, ok, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"generate: {name} must be {allowed}, got {value!r}")
    if not ok(value):
        raise ValueError(f"generate: {name} must be {allowed}, got {value!r}")
    return float(value)


def _token(name: str, value: Any, vocab: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
            not 0 <= value < vocab:
        raise ValueError(f"generate: {name} must be token ids in 0..{vocab - 1}, got {value!r}")
    return int(value)


def _eos(name: str, value: Any, vocab: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    ids = value if isinstance(value, (list, tuple)) else [value]
    return tuple(_token(name, i, vocab) for i in ids)


def _configs(model_config: Any, given: Any) -> dict[str, Any]:
    """The generation configs a call reads, first to last, by the name errors give them: the
    call's ``generation_config`` (HF's: its fields over the model's), the model's."""
    configs = {}
    if given is not None:
        from transformers import GenerationConfig

        if not isinstance(given, GenerationConfig):
            raise TypeError(f"generate: generation_config must be a transformers "
                            f"GenerationConfig, got {type(given).__name__}")
        configs["generation_config"] = given
    if model_config is not None:
        configs["model.generation_config"] = model_config
    return configs


def resolve(config: Any, kwargs: dict[str, Any], vocab: int) -> Decoding:
    """The :class:`Decoding` of a call's ``kwargs`` (its keyword arguments but the ids) over
    the model's generation ``config`` (None: HF's defaults only); ``vocab``: the model's
    vocabulary size (token ids must be below it). A value a generation config gave is named
    with it in errors."""
    configs = _configs(config, kwargs.get("generation_config"))
    check_kwargs(kwargs, configs)
    names: dict[str, str] = {}

    def get(name: str) -> Any:
        value = kwargs.get(name)
        names[name] = name
        for where, cfg in configs.items():
            if value is None and _config_value(cfg, name) is not None:
                value = _config_value(cfg, name)
                names[name] = f"{name} (from {where})"
        return DEFAULTS.get(name) if value is None else value

    v = {name: get(name) for name in ("do_sample", "max_new_tokens", "max_length",
                                      "min_new_tokens", "temperature", "top_k", "top_p",
                                      "repetition_penalty", "eos_token_id", "pad_token_id")}
    do_sample = v["do_sample"]
    if type(do_sample) is not bool:
        raise TypeError(f"generate: {names['do_sample']} must be True or False, got "
                        f"{do_sample!r}")
    generator = kwargs.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generate: generator must be a torch.Generator, got {generator!r}")
    eos = _eos(names["eos_token_id"], v["eos_token_id"], vocab)
    pad = v["pad_token_id"]
    pad = _token(names["pad_token_id"], pad, vocab) if pad is not None else \
        (eos[0] if eos else None)
    new = v["max_new_tokens"]
    return Decoding(
        max_new_tokens=None if new is None else _int(names["max_new_tokens"], new, 1),
        max_length=_int(names["max_length"], v["max_length"], 1),
        min_new_tokens=_int(names["min_new_tokens"], v["min_new_tokens"], 0),
        do_sample=do_sample,
        temperature=_real(names["temperature"], v["temperature"],
                          lambda t: t > 0 or not do_sample, "a number > 0 (with do_sample=True)"),
        top_k=_int(names["top_k"], v["top_k"], 0),
        top_p=_real(names["top_p"], v["top_p"], lambda p: 0 <= p <= 1, "a number in [0, 1]"),
        repetition_penalty=_real(names["repetition_penalty"], v["repetition_penalty"],
                                 lambda r: r > 0, "a number > 0"),
        eos=eos, pad=pad, generator=generator)


def check_inputs(input_ids: Any, attention_mask: Any, vocab: int) -> torch.Tensor:
    """The prompt's attention mask (all ones when None) after checking both: ``input_ids`` a
    2-D integer tensor (batch, tokens), neither empty, ids in 0..vocab-1; the mask of the
    same shape, of 0s and 1s, each row left-padded (its 0s before its 1s) and holding a
    token."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"generate: input_ids must be a 2-D tensor of token ids (batch, tokens), "
                        f"got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        hint = " (one prompt: input_ids[None])" if input_ids.dim() == 1 else ""
        raise ValueError(f"generate: input_ids must be 2-D (batch, tokens), got shape "
                         f"{tuple(input_ids.shape)}{hint}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or \
            input_ids.dtype == torch.bool:
        raise TypeError(f"generate: input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError(f"generate: input_ids is empty (shape {tuple(input_ids.shape)}): each "
                         f"prompt needs at least one token")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"generate: input_ids must be token ids in 0..{vocab - 1} (the model's "
                         f"vocabulary), got values in {low}..{high}")
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"generate: attention_mask must be a tensor of 0s and 1s, got "
                        f"{type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"generate: attention_mask must have input_ids' shape "
                         f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("generate: attention_mask must hold only 0s (padding) and 1s (tokens)")
    mask = attention_mask.long()
    if (mask[:, 1:] < mask[:, :-1]).any():
        row = int((mask[:, 1:] < mask[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"generate: attention_mask row {row} has a 0 after a 1: only left "
                         f"padding is supported (the tokenizer's padding_side='left')")
    if not mask[:, -1].all():
        row = int((mask[:, -1] == 0).nonzero()[0])
        raise ValueError(f"generate: attention_mask row {row} is all 0s: each prompt needs a "
                         f"token")
    return mask


__all__ = ["CONFIG_NEUTRAL", "DEFAULTS", "Decoding", "NEUTRAL", "SUPPORTED", "check_inputs",
           "check_kwargs", "resolve"]

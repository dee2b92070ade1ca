"""The fixed sets of names the configuration offers, and the N:M pattern parser: torch-free, so
that the command line is checked before torch is imported (``sparsekit``'s first answer to a
mistake comes in about a second). Each implementing module imports its set from here.

>>> parse_pattern("2:4"), "global" in SCOPES
((2, 4), True)
"""

from __future__ import annotations

import re

from sparsekit.errors import ConfigTypeError, UsageError

#: Pruner / ChannelPruner scope: each tensor reaches the target, or one threshold over all
SCOPES = ("layer", "global")
#: sk.Distiller's losses and what it matches (prune/distill.py)
DISTILL_LOSSES = ("auto", "kl", "cosine", "mse")
DISTILL_TARGETS = ("auto", "logits", "last_hidden", "pooled")
#: train.distributed: how ranks share the model (run/distributed.py)
DISTRIBUTED_MODES = ("auto", "none", "ddp", "fsdp2")
#: quant.method: post-training quantization by rounding or by GPTQ (quant/gptq.py)
QUANT_METHODS = ("rtn", "gptq")
#: model.task -> the transformers Auto class that builds it (models/hf.py)
AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "feature_extraction": "AutoModel",
}

#: quant.group_size / group_size=: the int4 weight schemes' groups (quant/formats.py): a fixed
#: group of inputs per scale, one scale per output channel, or per layer the largest that fits
INT4_GROUP_SIZES = (128, 64, 32)
GROUP_SIZE_CHOICES = (*INT4_GROUP_SIZES, "channel", "auto")

_NM = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_pattern(pattern: str) -> tuple[int, int] | None:
    """``"unstructured"`` -> None; ``"N:M"`` (0 < N < M) -> ``(N, M)``.

    >>> parse_pattern("2:4")
    (2, 4)
    >>> parse_pattern("unstructured") is None
    True
    """
    if not isinstance(pattern, str):
        raise ConfigTypeError(
            f"pattern must be a string ('unstructured' or 'N:M'), got {pattern!r}"
        )
    if pattern == "unstructured":
        return None
    match = _NM.match(pattern)
    if match is None:
        raise UsageError(
            f"unknown pattern {pattern!r}: allowed are 'unstructured' or 'N:M' with 0 < N < M, "
            "for example '2:4', '1:4', '4:8'"
        )
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise UsageError(f"pattern {pattern!r}: N:M needs 0 < N < M (N kept out of every M)")
    return n, m


def check_group_size(group_size: object, option: str = "group_size") -> int | str | None:
    """``group_size`` as one of :data:`GROUP_SIZE_CHOICES` (a number given as text, as on the
    command line, becomes an int), or None; UsageError naming ``option`` and the choices.

    >>> check_group_size("64"), check_group_size("auto"), check_group_size(None)
    (64, 'auto', None)
    """
    if group_size is None:
        return None
    value = group_size
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or value not in GROUP_SIZE_CHOICES:
        raise UsageError(f"{option}={group_size!r} is not allowed; choose one of: "
                         f"{', '.join(map(str, GROUP_SIZE_CHOICES))}")
    return value

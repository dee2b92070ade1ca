"""Output error of torchvision ViT-B/16 under sparsekit fp8 2:4, with and without the attention
in_proj layers quantized (torchao quantizes nn.Linear modules only, so it leaves a
MultiheadAttention's in_proj in bf16: this shows how much of a gap to torchao's error that
accounts for). Random weights, magnitude 2:4 on every Linear, CPU reference kernels.

    python tools/vit_fp8_error.py --batch 4 [--device cpu|cuda]

Prints one JSON line: relative L2 error of the features against fp32 of the same masked model
for bf16, fp8 2:4 on every Linear, fp8 2:4 with in_proj kept bf16, and fp8 2:4 with static
activation scales (``fp8_static``) calibrated on another batch of images.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torchvision
from torch import nn

import sparsekit as sk
from bench_models import magnitude_24_
from sparsekit.accel.convert import split_attention_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    vit = torchvision.models.vit_b_16().eval()
    vit.heads = nn.Identity()  # torchvision zero-initialises the head: compare features
    magnitude_24_(vit)
    vit = vit.to(args.device)
    x = torch.randn(args.batch, 3, 224, 224, device=args.device)
    with torch.no_grad():
        ref = vit(x).float()

    def err(y: torch.Tensor) -> float:
        return float((y.float() - ref).norm() / ref.norm())

    out = {"batch": args.batch, "device": args.device, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with torch.no_grad():
        out["bf16"] = err(copy.deepcopy(vit).bfloat16()(x.bfloat16()))
    for name, exclude in (("fp8_2:4_all", []), ("fp8_2:4_in_proj_bf16", ["*in_proj"])):
        m = copy.deepcopy(vit).bfloat16()
        split_attention_(m)  # in_proj becomes a Linear, so that it can be named
        fast = sk.accelerate(m, x, precision="fp8", sparsity="2:4", device=args.device,
                             compile=False, exclude=exclude)
        with torch.no_grad():
            out[name] = err(fast(x.bfloat16()))
    # static activation scales, calibrated on other images than the ones measured
    m = copy.deepcopy(vit).bfloat16()
    split_attention_(m)
    cal = torch.randn(x.shape, generator=torch.Generator().manual_seed(args.seed + 1))
    linears = [n for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
    sk.quantize_(m, "fp8_static", include=linears,
                 calibration=[cal.to(args.device, torch.bfloat16)])
    fast = sk.accelerate(m, x, precision="fp8", sparsity="2:4", device=args.device,
                         compile=False)
    with torch.no_grad():
        out["fp8_static_2:4_all"] = err(fast(x.bfloat16()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

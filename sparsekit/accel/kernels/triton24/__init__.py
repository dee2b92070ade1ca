"""triton24 kernels."""

from sparsekit.accel.kernels.triton24 import op  # noqa: F401  (registers the custom ops)

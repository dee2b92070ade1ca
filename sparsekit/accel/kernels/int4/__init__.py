"""int4 kernels."""

from sparsekit.accel.kernels.int4 import op  # noqa: F401  (registers the custom ops)

"""dense kernels."""

from sparsekit.accel.kernels.dense import op  # noqa: F401  (registers the custom ops)

"""mma_sp kernels."""

from sparsekit.accel.kernels.mma_sp import op  # noqa: F401  (registers the custom ops)

"""cusparselt kernels."""

from sparsekit.accel.kernels.cusparselt import op  # noqa: F401  (registers the custom ops)

"""attention kernels."""

from sparsekit.accel.kernels.attention import op  # noqa: F401  (registers the custom ops)

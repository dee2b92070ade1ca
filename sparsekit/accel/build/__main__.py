"""``python -m sparsekit.accel.build``: :func:`sparsekit.accel.build.main`."""

import sys

from sparsekit.accel.build import main

if __name__ == "__main__":
    sys.exit(main())

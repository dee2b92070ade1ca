"""``python -m sparsekit``: the same as the ``sparsekit`` command."""

from sparsekit.run.cli import main

if __name__ == "__main__":
    main()

"""``python -m labkit`` is the same as the ``labkit`` console script."""

from labkit.cli import main

if __name__ == "__main__":
    main()

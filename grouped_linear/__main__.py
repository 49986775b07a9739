"""``python -m grouped_linear``: the command line (``demo``, ``bench``)."""

from grouped_linear.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

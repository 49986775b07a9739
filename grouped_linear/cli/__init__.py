"""Command line tools: ``python -m grouped_linear demo`` and ``python -m grouped_linear bench``.

Optional dependencies (``grouped-linear[cli]``: tqdm, matplotlib) are imported
only here, and only when available or asked for.
"""

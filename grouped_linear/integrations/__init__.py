"""grouped_linear inside other libraries' models (imported on demand, never by the package)."""

__all__ = ["MissingDependency"]


class MissingDependency(ImportError):
    """An integration's library is not installed, or too old: the message says which and
    what to install."""

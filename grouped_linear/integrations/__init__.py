"""grouped_linear inside other libraries' models (imported on demand, never by the package)."""

"""Shared code of every SuperInfer service: wire schemas, stream names, settings, pure policy."""

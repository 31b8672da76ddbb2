"""Backends: objects that speak the PyTRIO client API (the real service, or the local model)."""

"""Backends built into core: :mod:`kvcache_core.backends.numpy`, the reference backend."""

"""Environments: the interface, built-in environments, and the verifiers bridges (classic API, v1 API)."""

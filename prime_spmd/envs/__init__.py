"""Environments: the interface, built-in environments, and the verifiers bridge."""

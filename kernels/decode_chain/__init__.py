"""Decode chain: every decoder layer of a one-row decode step in one Triton launch (ticket-ordered work items)."""

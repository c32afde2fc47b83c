"""Programmatic dependent launch (PDL, sm_90+) for the decode step's Triton kernels (kernels/pdl/README.md)."""

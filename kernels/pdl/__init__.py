"""Programmatic dependent launch (PDL, sm_90+) for the decode chain's Triton kernels (kernels/pdl/README.md)."""

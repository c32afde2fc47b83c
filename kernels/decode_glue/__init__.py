"""The decode step's small glue in one kernel each: the step's inputs (embedding rows, RoPE rows, attended lengths)
and the device state's advance after sampling (kernels/decode_glue/README.md)."""

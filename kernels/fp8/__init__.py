"""FP8 (e4m3) weights for the native engine: per-output-channel quantize, decode linears that read FP8, prefill GEMMs."""

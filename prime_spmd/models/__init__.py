"""Models: loading HF causal LMs from local files, the tiny-model builder, and our own model code."""

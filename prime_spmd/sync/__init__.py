"""Trainer -> inference weight transfer (``weights.py``).

Its own role, beside ``distributed/``: it composes the process groups and bridges of ``distributed/``
with the model side of a sync (LoRA adapters merged on the receiving side, ``models/lora.py``), which
``distributed/`` may not import.
"""

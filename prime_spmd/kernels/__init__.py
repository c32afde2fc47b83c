"""The Triton kernels, each beside a PyTorch reference (the repository's top-level ``kernels/`` folder, one
sub-package per kernel with its README.md), imported as ``prime_spmd.kernels.<name>``.

The folder has no ``__init__.py`` of its own, so a bare ``import kernels`` never finds it: that name belongs to
Hugging Face's ``kernels`` distribution, which transformers >= 5.25 installs and imports. This package's search path
is the folder itself (a source checkout: `pip install -e .` or PYTHONPATH).
"""

import os

__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")]

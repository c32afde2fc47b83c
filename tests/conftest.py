import os
import sys
from pathlib import Path

import torch

# On CPU the Triton kernels run under the interpreter; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

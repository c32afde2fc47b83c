import os
import sys
from pathlib import Path

# Tests import kernels under the Triton interpreter on CPU; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

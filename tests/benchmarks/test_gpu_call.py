"""scripts/gpu_call.sh, the device call's wrapper: it runs gpu_suite.sh from the committed tree in .gpu/head.tar
with PRIME_SPMD_COMMIT set and leaves $OUT/results_PART[_VARIANT].tar.gz with what the part wrote (stand-in python3 and
nvidia-smi on PATH; an unknown part, so the suite stops at once)."""

from __future__ import annotations

import os
import stat
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_call_runs_the_archived_tree_and_tars_its_output(tmp_path) -> None:
    repo, out, bin_dir = tmp_path / "repo", tmp_path / "out", tmp_path / "bin"
    for d in (repo / ".gpu", repo / ".whl", out, bin_dir):
        d.mkdir(parents=True)
    subprocess.run(["git", "archive", "HEAD", "-o", str(repo / ".gpu" / "head.tar")], cwd=ROOT, check=True)
    (repo / ".gpu" / "COMMIT").write_text("abc1234\n")
    (bin_dir / "python3").write_text('#!/bin/bash\necho "commit=$PRIME_SPMD_COMMIT $*" >> "$CALLS"\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho stub\n")
    for f in bin_dir.iterdir():
        f.chmod(stat.S_IRWXU)
    calls = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "OUT": str(out),
           "GPU_CALL_TMP": str(tmp_path / "t")}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_call.sh"), "no_such_part", "60"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "commit abc1234 part no_such_part" in proc.stdout and "rc=2" in proc.stdout
    assert calls.read_text().splitlines()[0].startswith("commit=abc1234 -m pip install")
    assert [f.name for f in out.iterdir()] == ["results_no_such_part.tar.gz"]
    with tarfile.open(out / "results_no_such_part.tar.gz") as tar:
        names = tar.getnames()
        log = tar.extractfile("o/suite.log").read().decode()
    assert "o/COMMIT" in names and "unknown part no_such_part" in log
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_call.sh"), "no_such_part two words", "60"], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (out / "results_no_such_part_two_words.tar.gz").is_file()  # a second part in the call: its own file
    (repo / ".gpu" / "head.tar").unlink()  # nothing archived: refused, naming what is missing
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_call.sh"), "tests", "60"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "no .gpu/head.tar" in proc.stdout

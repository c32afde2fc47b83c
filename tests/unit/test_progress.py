"""Progress in plain (non-TTY) mode: periodic lines, a final line, no control characters."""

from __future__ import annotations

import re

from prime_spmd.progress import Progress, format_duration

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
LINE = re.compile(r"^gen: (\d+)/4 \[\d+:\d\d<\d+:\d\d, [0-9.e+]+/s\]( .*)?$")


def test_plain_lines(capsys):
    p = Progress(total=4, desc="gen", interval_s=0.0)
    p.update(1, reward=0.123456, step=3)
    p.update(3, note="a\x1bb")
    p.close()
    err = capsys.readouterr().err
    assert not CONTROL.search(err), repr(err)
    lines = err.splitlines()
    assert len(lines) == 2 and all(LINE.match(line) for line in lines), lines
    assert lines[0].endswith("reward=0.1235 step=3")
    assert lines[1].startswith("gen: 4/4") and lines[1].endswith("note=ab")


def test_throttled_and_final_line_on_close(capsys):
    with Progress(total=100, desc="gen", interval_s=1e9) as p:
        for _ in range(10):
            p.update()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: 10/100")


def test_disabled_prints_nothing(capsys):
    p = Progress(total=2, desc="gen", enabled=False, interval_s=0.0)
    p.update(2)
    p.close()
    assert capsys.readouterr().err == ""


def test_format_duration():
    assert [format_duration(s) for s in (0, 75, 3725, -1)] == ["0:00", "1:15", "1:02:05", "0:00"]

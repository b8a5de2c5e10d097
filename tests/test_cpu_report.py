"""`pytest --cpu-report` (tests/cpu_report.py): each module's CPU seconds, its child processes'
included, summed over xdist's workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))

BUSY = textwrap.dedent('''
    import subprocess, sys, time

    def test_a_child_works_a_second():
        subprocess.run([sys.executable, "-c",
                        "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass"],
                       check=True)

    def test_sleeps():
        time.sleep(0.5)
''')
IDLE = "def test_nothing():\n    pass\n"


def _pytest(tmp_path, *args):
    (tmp_path / "test_busy.py").write_text(BUSY)
    (tmp_path / "test_idle.py").write_text(IDLE)
    env = dict(os.environ, PYTHONPATH=TESTS)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "cpu_report", "-p", "no:cacheprovider",
                           "-q", "-n", "2", *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_report_counts_child_processes_across_workers(tmp_path):
    proc = _pytest(tmp_path, "--cpu-report")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {m.group(5): [float(m.group(i)) for i in range(1, 5)]
            for m in re.finditer(r"^\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)$", proc.stdout, re.M)}
    busy, idle, total = rows["test_busy.py"], rows["test_idle.py"], rows["total"]
    cpu, own, children, wall = busy
    assert children >= 0.9, proc.stdout  # the child's busy second
    assert abs(cpu - own - children) <= 0.1 + 1e-9, proc.stdout  # each printed to 0.1 s
    assert wall >= 1.4, proc.stdout  # the child's second and the half-second sleep
    assert idle[0] < 0.5 and idle[2] == 0.0, proc.stdout
    assert abs(total[0] - busy[0] - idle[0]) < 0.2, proc.stdout
    # Sorted by CPU, the busy module first.
    assert proc.stdout.index("test_busy.py") < proc.stdout.index("test_idle.py"), proc.stdout


def test_no_report_unless_asked(tmp_path):
    proc = _pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CPU seconds per module" not in proc.stdout

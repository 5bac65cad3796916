"""Run a runner script of this folder in a fresh Python process (CUDA must not be initialised
before it spawns its workers) and return the JSON it prints on its ``RESULT`` line."""

import json
import subprocess
import sys
from pathlib import Path


def runner_result(name: str, timeout: int):
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(name))], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])

"""The README's adoption snippet, taken from README.md as printed, trains on 2 CPU processes."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def adoption_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Adopting it in an existing Lightning project", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under the README's adoption section"
    return match.group(1)


def test_readme_adoption_snippet_runs_verbatim(tmp_path):
    script = tmp_path / "adopt.py"
    script.write_text(adoption_snippet())
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "`Trainer.fit` stopped: `max_steps=" in run.stderr + run.stdout
    checkpoints = list((tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*step=20.ckpt"))
    assert len(checkpoints) == 1 and (checkpoints[0] / ".metadata").exists()  # both ranks' distributed checkpoint

"""Check that the README's main job left what the README says it does in runs/tiny_cpu/:
metrics with training and validation losses, checkpoints (last.ckpt among them) and the
expert-load heatmaps."""

import csv
import sys
from pathlib import Path

runs = sorted(Path("runs/tiny_cpu").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
if not runs:
    sys.exit("no runs/tiny_cpu/version_* directory")
run = runs[-1]
rows = list(csv.DictReader((run / "metrics.csv").open()))
val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
problems = []
if not train or not val:
    problems.append(f"metrics.csv holds {len(train)} train/loss and {len(val)} val/loss values")
elif not val[-1] < 3.37:  # the validation split's unigram entropy (nats per byte)
    problems.append(f"final val/loss {val[-1]:.3f} is not below the unigram entropy 3.37")
checkpoints = run / "checkpoints"
if not (checkpoints / "last.ckpt").exists():
    problems.append(f"no {checkpoints / 'last.ckpt'}")
heatmaps = sorted((run / "moe_heatmaps").glob("*.png"))
if len(heatmaps) != 4:  # heatmap_every_n_steps: 100 over 400 steps
    problems.append(f"{len(heatmaps)} heatmaps in {run / 'moe_heatmaps'}, expected 4")
if problems:
    sys.exit("main job: " + "; ".join(problems))
print(f"main job: {run}: val/loss {val[-1]:.3f}, {len(list(checkpoints.iterdir()))} checkpoint entries, "
      f"{len(heatmaps)} heatmaps")

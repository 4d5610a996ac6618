"""Tutorial 06: from a CSV click log to a trained model, in one command.

    python tutorials/06_csv_click_log.py                 # 40 000 training rows, 2 epochs
    python tutorials/06_csv_click_log.py --rows 6000     # small (what the tests run)

What it does:
  1. writes a click log as CSV files — a header, then one row per (user, item) impression:
     user_id, item_id, gender, occupation, age, genres ("Comedy|Drama"), rating — where a hidden
     taste of each user for each genre and item decides the rating, and a rating >= 4 is a click;
     the last 20% of the rows go to a held-out file;
  2. writes a schema (schema.yaml) saying which column is the label and what each feature is;
  3. runs the command line, as you would in a shell:
        hetps train --data train.csv --schema schema.yaml --model wide_deep \\
                    --epochs 2 --eval-data test.csv
     which reads the files with the schema (vectorised, 2 reader trainers each reading half of
     the file), builds Wide&Deep with the feed widths and vocabulary the schema gives, transpiles
     it, trains it on trainer and parameter-server processes and prints the held-out AUC.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

GENRES = ["Action", "Comedy", "Drama", "Romance", "War", "Horror", "Sci-Fi", "Documentary"]
SCHEMA = """\
label: rating            # a rating of 4 or 5 is a click
label_threshold: 4
dense: [age]
transform: standardize   # (age - mean) / std, measured on the training file
sparse: [user_id, item_id, gender, occupation]
multi: {genres: "|"}     # a bag of ids
max_len: 4
vocab: 20000
"""


def click_log(rows: int, seed: int = 0) -> list[str]:
    """CSV lines of a synthetic click log whose ratings follow hidden user and item tastes."""
    rng = np.random.default_rng(seed)
    users, items = max(rows // 40, 50), max(rows // 60, 40)
    taste = rng.normal(0, 1.2, (users, len(GENRES)))  # per user and genre
    item_genres = [rng.choice(len(GENRES), rng.integers(1, 4), replace=False) for _ in range(items)]
    item_bias = rng.normal(0, 0.8, items)
    gender = rng.choice(["F", "M"], users)
    occupation = rng.integers(0, 21, users)
    age = rng.integers(18, 70, users)
    u = np.minimum(rng.zipf(1.3, rows) - 1, users - 1)  # a few very active users
    i = rng.integers(0, items, rows)
    lines = []
    for r in range(rows):
        g = item_genres[i[r]]
        score = taste[u[r], g].mean() + item_bias[i[r]] + 0.02 * (age[u[r]] - 40) * (g[0] == 4)
        rating = int(np.clip(np.round(3 + score + rng.normal(0, 0.5)), 1, 5))
        lines.append(
            f"{u[r]},{i[r]},{gender[u[r]]},{occupation[u[r]]},{age[u[r]]},"
            f"{'|'.join(GENRES[k] for k in g)},{rating}"
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=40_000, help="rows of the click log (80%% train)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--model", default="wide_deep", choices=("wide_deep", "deepfm", "dlrm"))
    ap.add_argument("--out", help="directory for the files, kept (default: a temporary one, removed)")
    args = ap.parse_args(argv)

    if args.out is None:  # files in a temporary directory, removed at the end
        with tempfile.TemporaryDirectory(prefix="hetps-tutorial-06-") as tmp:
            return run(args, Path(tmp))
    return run(args, Path(args.out))


def run(args: argparse.Namespace, out: Path) -> dict:
    # 1. The click log: train.csv and a held-out test.csv.
    out.mkdir(parents=True, exist_ok=True)
    lines = click_log(args.rows)
    cut = len(lines) * 4 // 5
    head = "user_id,item_id,gender,occupation,age,genres,rating\n"
    for name, part in (("train.csv", lines[:cut]), ("test.csv", lines[cut:])):
        (out / name).write_text(head + "\n".join(part) + "\n")
    clicks = np.mean([int(line.rsplit(",", 1)[1]) >= 4 for line in lines])
    print(
        f"wrote {out / 'train.csv'} ({cut} rows) and test.csv ({len(lines) - cut}); "
        f"{clicks:.0%} clicks. First rows:\n{head}{lines[0]}\n{lines[1]}"
    )

    # 2. The schema.
    (out / "schema.yaml").write_text(SCHEMA)

    # 3. One command: read, build, transpile, train, score the held-out file.
    files = {"--data": out / "train.csv", "--schema": out / "schema.yaml", "--eval-data": out / "test.csv"}
    options = f"--model {args.model} --epochs {args.epochs} --batch-size 256 --trainers cpu=2,gpu=1"
    cmd = [sys.executable, "-m", "runtime.cli", "train", *(str(x) for kv in files.items() for x in kv)]
    cmd += [*options.split(), "--allow-emulation", "--no-progress"]
    print("$ hetps " + " ".join(cmd[3:]))
    root = Path(__file__).resolve().parents[1]  # run from this checkout, as `pip install -e .` would
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    print(done.stdout + done.stderr, end="")
    if done.returncode != 0:
        raise SystemExit(f"hetps train failed (exit {done.returncode})")
    score = float(re.search(r"held-out AUC (\d\.\d+)", done.stdout).group(1))
    return {"auc": score, "out": str(out)}


if __name__ == "__main__":
    main()

"""Files the tests read, all inside the repository."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The small exported ONNX models the tutorials, docs and tests use (tutorials/models/README.md).
MODELS = ROOT / "tutorials" / "models"

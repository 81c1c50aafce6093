"""Files shipped with MoEScope: the embedded demo model, the model catalog, icons."""

from pathlib import Path

RESOURCES_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = RESOURCES_DIR / "models" / "demo"

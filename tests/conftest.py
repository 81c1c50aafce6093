import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Keep MoEScope's user files (cache, history, settings) away from the real home directory.
_user_dirs = tempfile.mkdtemp(prefix="moescope-test-home-")
for _var in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME"):
    os.environ[_var] = os.path.join(_user_dirs, _var.lower())
# ... and the models other apps downloaded (LM Studio under ~, Ollama's store) away from the real ones
os.environ["HOME"] = os.path.join(_user_dirs, "home")
os.makedirs(os.environ["HOME"], exist_ok=True)
os.environ.pop("OLLAMA_MODELS", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist each worker takes its share of the cores, for torch, the native kernels' OpenMP
# and the engines it starts: two workers each running 2 threads on 2 cores spend the time waiting on
# each other. The tests that check a split across threads set their thread count themselves.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from engine.system.process_settings import apply_process_settings  # noqa: E402

apply_process_settings()  # as the entry points do: the stock references run in MKL's reproducible mode too

import pytest  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from tests.helpers.checkpoints import FAMILIES, save_tiny_checkpoint  # noqa: E402

hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def mixtral_checkpoint(tiny_checkpoints):
    return tiny_checkpoints["mixtral"]


def _runnable_variants() -> list[str]:
    """The kernel variants of this install the CPU can run (their names), best first."""
    from engine.decode.native import library

    return [v.name for v in library.runnable()]


@pytest.fixture(scope="module", params=_runnable_variants() or ["none"])
def variant(request):
    """Each variant of the native kernels this CPU can run, held to the same reference."""
    from engine.decode.native import library

    if request.param == "none":
        pytest.skip(library.choose().problem or "no kernel variant of this install runs here")
    chosen = next(v for v in library.variants() if v.name == request.param)
    return library.Kernels(library.LIB_DIR / chosen.file, chosen)


@pytest.fixture(scope="session")
def kernels():
    """--fast-decode's native kernels, the variant this machine runs (skips where the install has none)."""
    import shutil

    from engine.decode.native import kernels as decode_kernels

    loaded = decode_kernels.load()
    if loaded is None:
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(f"a C++ compiler is here but no kernels loaded: {decode_kernels.status()} "
                        "(run pip install -e . to build them)")
        pytest.skip(decode_kernels.status())
    return loaded


HEAVY = ("kernels", "process", "bench")  # what `--quick` leaves out


def pytest_addoption(parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="the inner-loop subset: leaves out tests marked " + ", ".join(HEAVY) + " (CI runs everything)")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that use the native kernels carry the `kernels` marker; `--quick` deselects the heavy ones."""
    for item in items:
        if {"kernels", "variant"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kernels)
    if config.getoption("--quick"):
        heavy = [item for item in items if any(item.get_closest_marker(m) for m in HEAVY)]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if item not in heavy]

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
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import engine  # noqa: E402, F401  (MKL's reproducible mode, for the stock references too: before MKL's first call)
from tests.helpers.checkpoints import FAMILIES, save_tiny_checkpoint  # noqa: E402

hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def mixtral_checkpoint(tiny_checkpoints):
    return tiny_checkpoints["mixtral"]


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def flavour(request):
    """Each build flavour of the kernels (x86-64; elsewhere only the native one)."""
    import platform

    from engine.decode.native import kernels as native
    from tests.helpers import kernel_builds

    if request.param != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the avx2 and portable flavours are x86-64 -march targets")
    built = native.wait(timeout=600)
    if request.param == "native":
        if built is None:
            pytest.skip(native.status())
        return built
    other = kernel_builds.flavour(request.param)
    if other is None:
        pytest.skip("the native build is the avx2 flavour on this CPU (AVX2 without AVX-512 or VNNI)")
    return other


@pytest.fixture(scope="session")
def kernels():
    """--fast-decode's native kernels, built for this machine (skips where no C++ compiler is)."""
    import shutil

    from engine.decode.native import kernels as decode_kernels

    built = decode_kernels.wait(timeout=600)
    if built is None:
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(f"a C++ compiler is here but the kernels did not build: {decode_kernels.status()}")
        pytest.skip(decode_kernels.status())
    return built


HEAVY = ("kernels", "process", "bench")  # what `--quick` leaves out


def pytest_addoption(parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="the inner-loop subset: leaves out tests marked " + ", ".join(HEAVY) + " (CI runs everything)")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that use the native kernels carry the `kernels` marker; `--quick` deselects the heavy ones;
    the kernel builds the remaining tests need start now, in the background (tests/helpers/kernel_builds.py)."""
    for item in items:
        if "kernels" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kernels)
    if config.getoption("--quick"):
        heavy = [item for item in items if any(item.get_closest_marker(m) for m in HEAVY)]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if item not in heavy]
    if any(item.get_closest_marker("kernels") for item in items):
        from tests.helpers import kernel_builds

        flavours = ("avx2", "portable") if any("flavour" in getattr(item, "fixturenames", ()) for item in items) else ()
        kernel_builds.start(flavours)

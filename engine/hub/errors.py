"""Hub and download failures as one-line user messages (what is wrong, what to do)."""

from __future__ import annotations

import contextlib
import errno

from engine.errors import MoEScopeError


class HubError(MoEScopeError):
    kind = "hub"


class RepoNotFoundError(HubError):
    kind = "repo-not-found"


class GatedRepoError(HubError):
    kind = "gated-repo"


class OfflineError(HubError):
    kind = "offline"


class NetworkError(HubError):
    kind = "network"


class DiskFullError(HubError):
    kind = "disk-full"


class DownloadCancelled(HubError):
    kind = "cancelled"


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC from a plain write, or the same failure reported as text by hf_xet's Rust side."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return True
    return "no space left on device" in str(exc).lower()


def translate(exc: BaseException, repo_id: str, *, endpoint: str, what: str = "download") -> MoEScopeError:
    """Turn a huggingface_hub / network / OS exception into a MoEScope error with one clear line.

    Order matters: huggingface_hub's GatedRepoError is a RepositoryNotFoundError, and its HTTP
    errors are OSErrors.
    """
    from huggingface_hub import errors as hf_errors

    if isinstance(exc, MoEScopeError):
        return exc
    page = f"{endpoint}/{repo_id}"
    if isinstance(exc, hf_errors.GatedRepoError):
        return GatedRepoError(
            f"'{repo_id}' is gated: accept its terms at {page} while logged in, then log in here with "
            "`hf auth login` (or set HF_TOKEN) and try again"
        )
    if isinstance(exc, hf_errors.DisabledRepoError):
        return RepoNotFoundError(f"'{repo_id}' has been disabled on the Hub; pick another model")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return RepoNotFoundError(
            f"no model '{repo_id}' on the Hugging Face Hub (or it is private and you are not logged in); "
            "check the name, e.g. with `moescope models search mixtral`"
        )
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return RepoNotFoundError(f"'{repo_id}' has no such revision (branch, tag or commit); leave --revision out for the latest")
    if isinstance(exc, hf_errors.RemoteEntryNotFoundError):
        return HubError(f"a file of '{repo_id}' disappeared from the Hub during the {what}; run it again")
    if isinstance(exc, hf_errors.OfflineModeIsEnabled) or (
        isinstance(exc, hf_errors.LocalEntryNotFoundError) and _offline()
    ):
        return OfflineError(
            f"HF_HUB_OFFLINE is set, so the Hub is not contacted for '{repo_id}': unset it to {what}, "
            "or use a model already downloaded (`moescope models list`)"
        )
    if isinstance(exc, hf_errors.HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status in (401, 403):
            return GatedRepoError(
                f"the Hub refused access to '{repo_id}' (HTTP {status}): your token is missing, invalid or lacks "
                f"access; log in with `hf auth login` (or set HF_TOKEN) and check {page}"
            )
        return HubError(f"the Hugging Face Hub answered HTTP {status} for '{repo_id}'; try again later")
    if is_disk_full(exc):
        return DiskFullError(
            f"the disk filled up during the {what} of '{repo_id}': free some space (or point HF_HUB_CACHE at a "
            "bigger disk) and run it again; finished files are kept"
        )
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return HubError(f"a file of '{repo_id}' arrived incomplete (network trouble); run the {what} again")
    if _is_network_error(exc):
        return NetworkError(
            f"cannot reach the Hugging Face Hub at {endpoint} for '{repo_id}': check your internet connection "
            "or proxy and try again; models already downloaded still work offline"
        )
    if isinstance(exc, PermissionError):
        return HubError(f"no permission to write the Hugging Face cache ({exc.filename}); fix its permissions or set HF_HUB_CACHE")
    return HubError(f"the {what} of '{repo_id}' failed: {exc}")


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _is_network_error(exc: BaseException) -> bool:
    from huggingface_hub import errors as hf_errors

    kinds: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, hf_errors.LocalEntryNotFoundError)
    for module in ("httpx2", "httpx"):  # huggingface_hub 2.x talks through httpx2, 1.x through httpx
        with contextlib.suppress(ImportError, AttributeError):
            kinds += (__import__(module).TransportError,)
    return isinstance(exc, kinds)

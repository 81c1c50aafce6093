"""GGUF repositories on the Hub: which quant files a repo offers, and each one's header, fetched alone.

A GGUF repo (e.g. unsloth/Qwen3-30B-A3B-GGUF) holds one file per quant type, or one split set
(`-00001-of-0000N.gguf`) per quant, often in a sub-folder per quant. Each is one choice. Its size
estimate comes from its header: the first bytes of every part, fetched with HTTP Range requests and
parsed in memory (engine.model.gguf.header), so a 100 GiB choice is sized from a few MiB of traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.hub.gguf_info import GGUFHeader, GGUFProblem, header_of
from engine.hub.remote import RemoteFile
from engine.model.gguf.file import SPLIT_NAME
from engine.model.gguf.header import BadHeader, ParsedHeader, ShortHeader, parse_header

HEADER_BYTES = 8 * 1024**2  # first try: metadata with a 150k-token vocabulary and the tensor table fit
MAX_HEADER_BYTES = 256 * 1024**2
# llama.cpp's quant names as they appear in file names (Q4_K_M, IQ2_XXS, Q8_0, BF16, MXFP4 ...)
QUANT_IN_NAME = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[0-9A-Z]+)*|BF16|F16|F32|MXFP4(?:_MOE)?)(?![A-Za-z0-9])",
                           re.IGNORECASE)


@dataclass
class GGUFChoice:
    """One quant file (or split set) of a GGUF repo."""

    label: str  # Q4_K_M, or the file name when it names no quant type
    files: list[RemoteFile]  # the part(s), first part first

    @property
    def size(self) -> int:
        return sum(f.size or 0 for f in self.files)

    @property
    def first(self) -> str:
        return self.files[0].name


def gguf_choices(files: list[RemoteFile]) -> list[GGUFChoice]:
    """The repo's GGUF model files grouped into choices (split sets as one, vision projectors left out),
    smallest first."""
    groups: dict[str, list[RemoteFile]] = {}
    for f in files:
        name = f.name.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or name.lower().startswith("mmproj"):
            continue
        split = SPLIT_NAME.match(f.name)
        groups.setdefault(split["prefix"] if split else f.name, []).append(f)
    choices = [GGUFChoice(quant_label(key), sorted(parts, key=lambda f: f.name)) for key, parts in groups.items()]
    return sorted(choices, key=lambda c: (c.size, c.label))


def pick_choice(remote, label: str) -> GGUFChoice:
    """The choice a download asked for by its label; one line listing the choices when none matches."""
    from engine.hub.errors import HubError

    choices = gguf_choices(remote.gguf_files)
    found = next((c for c in choices if c.label.lower() == label.strip().lower()), None)
    if found is None:
        names = ", ".join(c.label for c in choices) or "none"
        what = f"has no quant file '{label}'" if label else "is a GGUF repo"
        raise HubError(f"'{remote.repo_id}' {what}: pick one of its quant files to download ({names})")
    return found


def quant_label(name: str) -> str:
    found = QUANT_IN_NAME.findall(name.rsplit("/", 1)[-1])
    return found[-1].upper() if found else name.rsplit("/", 1)[-1]


def fetch_header(repo_id: str, sha: str, choice: GGUFChoice, *, endpoint: str, token: str | bool | None = None) -> GGUFHeader:
    """The header of a choice on the Hub, from the first bytes of each part."""
    parts = [Path(f.name) for f in choice.files]
    parsed = [_fetch_parsed(repo_id, sha, f, endpoint, token) for f in choice.files]
    return header_of(parts, parsed, [f.size or 0 for f in choice.files])


def _fetch_parsed(repo_id: str, sha: str, f: RemoteFile, endpoint: str, token) -> ParsedHeader:
    """Range requests for the first bytes until the header is whole (a bigger one when it runs past them)."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo_id, f.name, revision=sha, endpoint=endpoint)
    want = HEADER_BYTES
    while True:
        response = get_session().get(url, headers={**build_hf_headers(token=token), "Range": f"bytes=0-{want - 1}"},
                                     follow_redirects=True)
        response.raise_for_status()
        try:
            return parse_header(response.content)
        except ShortHeader as short:
            if len(response.content) < want or want >= MAX_HEADER_BYTES:  # the file (or our patience) ends here
                raise GGUFProblem(f"{f.name} of '{repo_id}' is truncated inside its header") from None
            want = min(MAX_HEADER_BYTES, max(2 * want, short.need + 1024**2))
        except BadHeader as exc:
            raise GGUFProblem(f"{f.name} of '{repo_id}' is not a readable GGUF file: {exc}") from None

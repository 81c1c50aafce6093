"""One source for the load and sampling settings: the protocol's dataclasses give the defaults and
the one range check, which the command line, the engine and the chat history all go through."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, fields

import pytest

from engine import protocol as p
from engine.cli.args import add_model_args, add_sampling_args, load_settings, sampling_settings
from engine.cli.main import main as moescope
from engine.process.client import EngineClient


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "-5"], "--max-new-tokens must be at least 1, got -5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or more, got -1"),
    (["--temperature", "nan"], "--temperature must be 0 (greedy) or more, got nan"),
    (["--top-p", "2"], "--top-p must be above 0 and at most 1, got 2"),
    (["--top-p", "0"], "--top-p must be above 0 and at most 1, got 0"),
    (["--top-k", "-3"], "--top-k must be 0 (off) or more, got -3"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be above 0, got 0"),
])
def test_out_of_range_sampling_is_refused_with_one_line_before_loading(capsys, tmp_path, argv, message):
    # The model does not exist: the settings are checked first, so the message is about them.
    code = moescope(["generate", "--model", str(tmp_path / "absent"), "--prompt", "hi", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"moescope: error: {message}"


def test_the_engine_refuses_the_same_settings_from_any_caller():
    # the worker and the server pass protocol settings straight to the generation loop
    problem = p.SamplingSettings(top_p=1.5).problem()
    assert problem == p.SettingProblem("top_p", "must be above 0 and at most 1, got 1.5")
    assert p.SamplingSettings().problem() is None
    assert p.SamplingSettings(temperature=0, top_p=1.0, max_new_tokens=1).problem() is None
    assert p.SamplingSettings(temperature=math.inf).problem() is None  # huge is allowed: nearly uniform sampling


def parse(argv: list[str], *, temperature: float | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    if temperature is None:
        add_sampling_args(parser)
    else:
        add_sampling_args(parser, temperature=temperature)
    return parser.parse_args(["--model", "demo", *argv])


def test_command_line_defaults_are_the_dataclasses_defaults():
    args = parse([])
    settings, load = sampling_settings(args), load_settings(args)
    assert settings == p.SamplingSettings()
    assert load == p.LoadModel(path="demo")
    # every load setting the command line offers maps onto the dataclass, under the same name
    offered = {f.name for f in fields(p.LoadModel)} & set(vars(args))
    assert offered >= {"budget", "store", "device", "policy", "dtype", "allocation", "cpu_experts", "trace",
                       "fast_decode", "pack_weights", "allow_pickle", "trust_remote_code"}
    # `generate` asks for greedy decoding explicitly; only the temperature differs
    greedy = sampling_settings(parse([], temperature=0.0))
    assert asdict(greedy) == asdict(p.SamplingSettings()) | {"temperature": 0.0}


def test_options_given_on_the_command_line_reach_the_settings():
    args = parse(["--budget", "25%", "--store", "disk", "--policy", "lfu", "--exact", "--no-pack-weights",
                  "--expert-format", "4bit", "--temperature", "0.2", "--top-p", "0.5", "--stop", "END", "--seed", "7"])
    load, settings = load_settings(args), sampling_settings(args)
    assert (load.budget, load.store, load.policy, load.fast_decode, load.pack_weights) == ("25%", "disk", "lfu", False,
                                                                                          False)
    assert load.expert_format == "4bit"
    assert (settings.temperature, settings.top_p, settings.stop, settings.seed) == (0.2, 0.5, ["END"], 7)


def test_native_kernels_are_the_default_and_fast_decode_is_an_accepted_old_spelling(capsys):
    assert p.LoadModel(path="demo").fast_decode and load_settings(parse([])).fast_decode
    assert not load_settings(parse(["--exact"])).fast_decode
    assert load_settings(parse(["--fast-decode"])).fast_decode
    assert "--fast-decode is the default now" in capsys.readouterr().err


def test_8_bit_inputs_are_opt_in_and_take_their_old_spelling_too():
    # --int8-prompt: the switch's name while it rounded prompts' inputs alone
    assert not p.LoadModel(path="demo").int8_inputs and not load_settings(parse([])).int8_inputs
    assert load_settings(parse(["--int8-inputs"])).int8_inputs
    assert load_settings(parse(["--int8-prompt"])).int8_inputs


def test_a_restart_reloads_with_the_live_changes_without_touching_the_sent_command():
    client = EngineClient(lambda event: None)  # never started: only what it remembers is looked at
    load = p.LoadModel(path="demo", budget="all", policy="lru")
    client._remember(load)
    for change in (p.SetBudget("25%"), p.SetPolicy("lfu"), p.SetFastDecode(False)):
        client._remember(change)
    assert (client.last_load.budget, client.last_load.policy, client.last_load.fast_decode) == ("25%", "lfu", False)
    assert (load.budget, load.policy, load.fast_decode) == ("all", "lru", True)  # the caller's object is its own


def test_reply_statistics_are_typed_and_survive_older_and_newer_history_rows():
    stats = p.ReplyStats(decode_tokens=5, decode_tokens_per_s=20.0, hit_rate=0.5)
    assert p.ReplyStats.from_dict(asdict(stats)) == stats
    assert p.ReplyStats.from_dict({"decode_tokens": 3, "a_field_from_a_newer_version": 1}) == p.ReplyStats(decode_tokens=3)

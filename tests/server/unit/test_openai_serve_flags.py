"""``slipstream serve``'s OpenAI flags (vLLM's names) become the API's settings, and flags that
cannot apply are refused before anything starts."""

from __future__ import annotations

import argparse

import pytest

from slipstream.server.launch.cli import add_serve_args, check_openai_args, openai_settings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(argv)


def test_the_flags_become_the_api_settings():
    args = parse(
        [
            "--api-key",
            "k1",
            "k2",
            "--served-model-name",
            "smol",
            "alias",
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
            "--reasoning-parser",
            "qwen3",
            "--pooler-config",
            '{"pooling_type": "MEAN"}',
        ]
    )
    settings = openai_settings(args)
    assert settings.api_keys == ("k1", "k2")
    assert settings.tool_call_parser == "hermes" and settings.enable_auto_tool_choice
    assert settings.reasoning_parser == "qwen3"
    assert args.served_model_name == ["smol", "alias"]
    assert args.pooler_config == {"pooling_type": "MEAN"}
    check_openai_args(args, ["slipstream"])


@pytest.mark.parametrize("variable", ["SLIPSTREAM_API_KEY", "VLLM_API_KEY"])
def test_the_api_key_may_come_from_the_environment(monkeypatch, variable):
    monkeypatch.delenv("SLIPSTREAM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv(variable, "secret")
    assert openai_settings(parse([])).api_keys == ("secret",)


@pytest.mark.parametrize(
    "argv, names, message",
    [
        (["--tool-call-parser", "nope"], ["m"], "unknown tool call parser 'nope'"),
        (["--reasoning-parser", "nope"], ["m"], "unknown reasoning parser 'nope'"),
        (["--enable-auto-tool-choice"], ["m"], "needs --tool-call-parser"),
        (["--pooler-config", '{"pooling_type": "MAX"}'], ["m"], "pooling_type"),
    ],
)
def test_flags_that_cannot_apply_are_refused_at_start(argv, names, message):
    with pytest.raises(SystemExit) as e:
        check_openai_args(parse(argv), names)
    assert message in str(e.value)


def test_several_served_names_reach_the_plan_the_first_one_naming_the_triton_model():
    from slipstream.server.launch.cli import serve_overrides, served_model_names

    args = parse(["--served-model-name", "smol", "alias"])
    overrides = serve_overrides(args)
    assert served_model_names(overrides["served_model_name"]) == ["smol", "alias"]
    assert served_model_names(
        serve_overrides(parse(["--served-model-name", "one"]))["served_model_name"]
    ) == ["one"]
    assert served_model_names(None) == []

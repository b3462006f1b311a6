"""config.pbtxt read and rewritten through protobuf's text format with Triton's ModelConfig:
what a regular expression got wrong (a commented-out parameter, the list form of the map, a
second entry appended by --set) is read and written as Triton reads it."""

import pytest

from slipstream.server.launch.config_pbtxt import (
    ConfigTextError,
    parse,
    read_parameters,
    set_parameters,
)
from slipstream.server.launch.repository import DEFAULT_MODEL_REPOSITORY, render_model_repository

LIST_FORM = """
name: "llm"
backend: "slipstream"
parameters [
  {
    key: "max_num_seqs"
    value: { string_value: "8" }
  },
  {
    key: "dtype"
    value: { string_value: "float32" }
  }
]
"""


def test_a_commented_out_parameter_is_not_set():
    text = """
backend: "slipstream"
# parameters: { key: "max_num_seqs" value: { string_value: "999" } }
parameters: { key: "dtype" value: { string_value: "bfloat16" } }  # trailing comment
"""
    assert read_parameters(text) == {"dtype": "bfloat16"}


def test_the_list_form_of_parameters_is_read():
    assert read_parameters(LIST_FORM) == {"max_num_seqs": "8", "dtype": "float32"}
    assert parse(LIST_FORM).backend == "slipstream"


def test_set_on_the_list_form_replaces_the_entry_instead_of_appending_one():
    out = set_parameters(LIST_FORM, {"max_num_seqs": 32, "seed": 7})
    assert read_parameters(out) == {"max_num_seqs": "32", "dtype": "float32", "seed": "7"}
    assert out.count('key: "max_num_seqs"') == 1
    assert parse(out).name == "llm"


def test_values_with_quotes_newlines_and_booleans_survive_a_rewrite():
    out = set_parameters('backend: "slipstream"\n', {"a": 'x"y\\z\nw', "b": True, "c": None})
    assert read_parameters(out) == {"a": 'x"y\\z\nw', "b": "true", "c": ""}


def test_a_rewrite_keeps_every_other_field_and_starts_with_its_header():
    source = (DEFAULT_MODEL_REPOSITORY / "slipstream" / "config.pbtxt").read_text()
    out = set_parameters(source, {"max_num_seqs": 4}, header="rendered\nby a test")
    assert out.startswith("# rendered\n# by a test\n")
    before, after = parse(source), parse(out)
    after.parameters["max_num_seqs"].string_value = before.parameters["max_num_seqs"].string_value
    assert after == before


def test_a_field_triton_would_refuse_is_refused_with_its_line():
    with pytest.raises(ConfigTextError, match=r"config.pbtxt: 2:1 .*max_batch_sise"):
        parse('backend: "slipstream"\nmax_batch_sise: 4\n')


def test_rendering_sets_a_parameter_given_in_list_form_once(tmp_path):
    model = tmp_path / "repo" / "llm"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(LIST_FORM)
    out = render_model_repository(tmp_path / "repo", tmp_path / "out", {"max_num_seqs": 2})
    text = (out / "llm" / "config.pbtxt").read_text()
    assert read_parameters(text)["max_num_seqs"] == "2"
    assert text.count('"max_num_seqs"') == 1
    assert "Rendered from" in text.splitlines()[0]

"""relayrl.config's parsers of files relayrl did not write, bounded: YAML refuses duplicate keys, nesting past 100
levels, alias bombs and cycles, and integers past the digit limit (each a YAMLError with its position); JSON
(parse_json) refuses nesting past 100 levels and integers past the digit limit as JSONDecodeError."""

import json

import pytest
import yaml

from relayrl.config import MAX_JSON_DEPTH, MAX_YAML_DEPTH, parse_json, parse_yaml

pytestmark = pytest.mark.unit


def yaml_problem(text: str) -> tuple[str, int]:
    with pytest.raises(yaml.YAMLError) as e:
        parse_yaml(text)
    return e.value.problem, e.value.problem_mark.line + 1


def test_a_key_written_twice_is_refused_naming_both_lines_but_merge_keys_still_override():
    assert yaml_problem("a: 1\nb:\n  c: 2\n  c: 3\n") == (
        "duplicate key 'c' (first at line 3): write each key once (merge the two blocks)", 4)
    assert parse_yaml("base: &b {lr: 1, x: 2}\nt:\n  <<: *b\n  lr: 3\n") == {"base": {"lr": 1, "x": 2},
                                                                          "t": {"lr": 3, "x": 2}}
    assert parse_yaml("a: {1: x, '1': y}") == {"a": {1: "x", "1": "y"}}  # different keys: an int and a string


def test_nesting_is_bounded_at_the_limit():
    assert parse_yaml("[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH) is not None
    assert yaml_problem("[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1)) == (
        "nested deeper than 100 levels", 1)


def test_aliases_are_counted_expanded_and_a_cycle_is_refused():
    # a list of 9,999 nodes and 9 aliases of it: 99,994 nodes in all, under the bound; 11 aliases make the list of
    # aliases alone 109,990 nodes, refused at its line
    base = "a: &a [" + ", ".join(["1"] * 9_998) + "]\n"
    assert len(parse_yaml(base + "b: [" + ", ".join(["*a"] * 9) + "]\n")["b"]) == 9
    problem, line = yaml_problem(base + "b: [" + ", ".join(["*a"] * 11) + "]\n")
    assert problem.startswith("the document expands to more than 100000 nodes") and line == 2
    assert yaml_problem("a: &x [1, *x]\n") == ("an alias refers to a node that contains it (a recursive document)", 1)


def test_an_integer_past_the_digit_limit_is_a_yaml_error():
    assert parse_yaml("n: " + "7" * 4300)["n"] == int("7" * 4300)
    assert yaml_problem("n: " + "7" * 4301) == ("an integer of 4301 digits is too long", 1)


def test_parse_json_bounds_depth_and_digits_and_parses_the_rest_as_json_does():
    doc = '{"a": [1, 2.5, null, true, {"b": "c"}], "d": 1e400}'
    assert parse_json(doc) == json.loads(doc) and parse_json(doc.encode()) == json.loads(doc)
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    past = MAX_JSON_DEPTH + 1
    for text, msg, col in [("[" * past + "]" * past, "nested deeper than 100 levels", 1),
                           ("[" * 200_000 + "]" * 200_000, "nested deeper than 100 levels", 1),
                           ('{"n": ' + "5" * 5000 + "}", "a number of 5000 digits is too long", 7)]:
        with pytest.raises(json.JSONDecodeError) as e:
            parse_json(text)
        assert (e.value.msg, e.value.colno) == (msg, col)

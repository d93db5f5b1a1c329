"""kvinject.settings: one YAML file (KVINJECT_CONFIG_FILE), environment
variables KVINJECT_<SECTION>_<KEY> and explicit values, resolved per key
(explicit > environment > file > default), every value checked, and every
bad input refused with a message naming the key, its source and the known
keys. The environment is a dict passed in (never the process's).

Needs only Python, and PyYAML for the file cases (skipped without it).
"""
from __future__ import annotations

import pytest

from kvinject.settings import CONFIG_FILE_VAR, SECTIONS, Field, describe, env_var, load_file, resolve

FIELDS = [
    Field("budget_mb", int, 256, lo=1, hi=1024, doc="memory"),
    Field("ratio", float, 0.5, lo=0.0, hi=1.0),
    Field("dtype", str, "fp32", choices=("fp32", "bf16")),
    Field("fast", bool, False),
    Field("path", str, None),
    Field("rope", dict, None),
    Field("ports", list, None),
]


def yaml_file(tmp_path, text):
    pytest.importorskip("yaml")
    p = tmp_path / "kvinject.yaml"
    p.write_text(text)
    return {CONFIG_FILE_VAR: str(p)}


def test_defaults_when_nothing_is_set():
    assert resolve("connector", FIELDS, environ={}) == {"budget_mb": 256, "ratio": 0.5, "dtype": "fp32",
                                                        "fast": False, "path": None, "rope": None, "ports": None}


def test_explicit_beats_environment_beats_file_beats_default(tmp_path):
    env = yaml_file(tmp_path, "connector:\n  budget_mb: 100\n  ratio: 0.25\n  dtype: bf16\ngateway:\n  x: 1\n")
    env["KVINJECT_CONNECTOR_BUDGET_MB"] = "200"
    env["KVINJECT_CONNECTOR_RATIO"] = "0.75"
    out = resolve("connector", FIELDS, {"budget_mb": 300}, environ=env)
    assert (out["budget_mb"], out["ratio"], out["dtype"], out["fast"]) == (300, 0.75, "bf16", False)
    # the gateway's section is the gateway's to check: not read for the connector
    assert resolve("connector", FIELDS, environ=env)["budget_mb"] == 200


def test_environment_strings_are_parsed_to_the_fields_type():
    env = {"KVINJECT_CONNECTOR_FAST": "yes", "KVINJECT_CONNECTOR_RATIO": "1", "KVINJECT_CONNECTOR_PATH": "/x",
           "KVINJECT_CONNECTOR_ROPE": '{"theta": 10000.0}', "KVINJECT_CONNECTOR_PORTS": "[1, 2]",
           "KVINJECT_OTHER": "ignored", "KVINJECT_GATEWAY_PORT": "not the connector's"}
    out = resolve("connector", FIELDS, environ=env)
    assert (out["fast"], out["ratio"], out["path"], out["rope"], out["ports"]) == (True, 1.0, "/x",
                                                                                   {"theta": 10000.0}, [1, 2])
    for text, value in (("1", True), ("0", False), ("TRUE", True), ("false", False), ("No", False)):
        assert resolve("connector", FIELDS, environ={"KVINJECT_CONNECTOR_FAST": text})["fast"] is value
    # an empty string unsets a field whose default is None
    assert resolve("connector", FIELDS, environ={"KVINJECT_CONNECTOR_PATH": ""})["path"] is None


def test_an_int_is_taken_for_a_float_and_none_for_an_optional_field():
    out = resolve("gateway", FIELDS, {"ratio": 1, "path": None, "rope": {"a": 1}})
    assert out["ratio"] == 1.0 and isinstance(out["ratio"], float) and out["path"] is None


@pytest.mark.parametrize("explicit, words", [
    ({"budget_mb": "64"}, ["budget_mb", "kv_connector_extra_config", "must be an integer", "'64'"]),
    ({"budget_mb": True}, ["budget_mb", "must be an integer", "True"]),
    ({"budget_mb": 0}, ["budget_mb", "= 0 is out of range (1..1024)"]),
    ({"budget_mb": 2048}, ["out of range (1..1024)"]),
    ({"ratio": 1.5}, ["ratio", "out of range (0.0..1.0)"]),
    ({"ratio": float("nan")}, ["ratio", "NaN"]),
    ({"dtype": "int4"}, ["dtype", "'int4' is not one of 'fp32', 'bf16'"]),
    ({"fast": 1}, ["fast", "must be a boolean"]),
    ({"budget_mb": None}, ["budget_mb", "got None"]),
    ({"rope": [1]}, ["rope", "must be a mapping"]),
    ({"budgetmb": 1}, ["unknown key(s) budgetmb in kv_connector_extra_config",
                       "known: budget_mb, dtype, fast, path, ports, ratio, rope"]),
])
def test_bad_explicit_values_are_refused_naming_key_and_source(explicit, words):
    with pytest.raises(ValueError) as e:
        resolve("connector", FIELDS, explicit, environ={}, explicit_source="kv_connector_extra_config")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("var, text, words", [
    ("KVINJECT_CONNECTOR_BUDGET_MB", "6.4", ["budget_mb (from KVINJECT_CONNECTOR_BUDGET_MB)", "an integer", "'6.4'"]),
    ("KVINJECT_CONNECTOR_BUDGET_MB", "", ["must be an integer"]),
    ("KVINJECT_CONNECTOR_BUDGET_MB", "0", ["KVINJECT_CONNECTOR_BUDGET_MB", "out of range"]),
    ("KVINJECT_CONNECTOR_FAST", "maybe", ["fast", "1/0/true/false/yes/no", "'maybe'"]),
    ("KVINJECT_CONNECTOR_RATIO", "half", ["ratio", "a number"]),
    ("KVINJECT_CONNECTOR_DTYPE", "fp8", ["KVINJECT_CONNECTOR_DTYPE", "not one of"]),
    ("KVINJECT_CONNECTOR_ROPE", "{theta: 1}", ["rope", "JSON"]),
    ("KVINJECT_CONNECTOR_ROPE", "[1]", ["rope", "must be a mapping"]),
    ("KVINJECT_CONNECTOR_BUDGET", "1", ["unknown variable KVINJECT_CONNECTOR_BUDGET ", "section connector",
                                        "KVINJECT_CONNECTOR_BUDGET_MB"]),
])
def test_bad_environment_variables_are_refused_naming_the_variable(var, text, words):
    with pytest.raises(ValueError) as e:
        resolve("connector", FIELDS, environ={var: text})
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("text, words", [
    ("connector:\n  budget_mb: 2000\n", ["budget_mb (from section connector of ", "out of range"]),
    ("connector:\n  budget: 2\n", ["unknown key(s) budget in section connector of ", "known: budget_mb"]),
    ("conector:\n  budget_mb: 2\n", ["unknown section(s) conector in ", "known: connector, gateway"]),
    ("connector: 5\n", ["section connector of ", "must be a mapping, got int"]),
    ("- connector\n", ["must hold a mapping of sections"]),
    ("connector: [\n", ["is not valid YAML"]),
    ("connector:\n  fast: maybe\n", ["fast", "must be a boolean", "'maybe'"]),
])
def test_bad_files_are_refused_naming_the_file(tmp_path, text, words):
    env = yaml_file(tmp_path, text)
    with pytest.raises(ValueError) as e:
        resolve("connector", FIELDS, environ=env)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    assert env[CONFIG_FILE_VAR] in msg


def test_an_empty_file_or_section_means_defaults(tmp_path):
    assert resolve("connector", FIELDS, environ=yaml_file(tmp_path, ""))["budget_mb"] == 256
    assert resolve("connector", FIELDS, environ=yaml_file(tmp_path, "connector:\ngateway:\n"))["budget_mb"] == 256
    assert load_file({}) is None


def test_a_missing_file_is_refused(tmp_path):
    path = str(tmp_path / "nowhere.yaml")
    with pytest.raises(ValueError, match="cannot read .*nowhere.yaml .named by KVINJECT_CONFIG_FILE"):
        resolve("connector", FIELDS, environ={CONFIG_FILE_VAR: path})


def test_without_pyyaml_a_named_file_is_refused_with_the_reason(monkeypatch, tmp_path):
    import builtins
    real = builtins.__import__

    def no_yaml(name, *a, **kw):
        if name == "yaml":
            raise ImportError("no yaml")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    with pytest.raises(ValueError, match="PyYAML is not installed"):
        resolve("connector", FIELDS, environ={CONFIG_FILE_VAR: str(tmp_path / "x.yaml")})
    assert resolve("connector", FIELDS, environ={})["budget_mb"] == 256  # no file named: no import


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="unknown section 'workers'"):
        resolve("workers", FIELDS, environ={})
    with pytest.raises(ValueError, match="declared twice"):
        resolve("connector", FIELDS + [Field("fast", bool, True)], environ={})
    with pytest.raises(ValueError, match="kv_connector_extra_config must be a mapping"):
        resolve("connector", FIELDS, [1], environ={}, explicit_source="kv_connector_extra_config")
    with pytest.raises(TypeError, match="type must be one of"):
        Field("x", tuple)
    with pytest.raises(ValueError, match="the default"):
        Field("x", int, 5, lo=10)


def test_names_and_rows():
    assert SECTIONS == ("connector", "gateway")
    assert env_var("gateway", "max_body_mb") == "KVINJECT_GATEWAY_MAX_BODY_MB"
    (row,) = [r for r in describe("connector", FIELDS) if r["name"] == "budget_mb"]
    assert row == dict(name="budget_mb", type="int", range="1..1024", choices=None, default=256,
                       env="KVINJECT_CONNECTOR_BUDGET_MB", doc="memory")

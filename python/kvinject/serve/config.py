"""The gateway's settings: command-line flags, else the environment
(``KVINJECT_GATEWAY_<KEY>``), else the ``gateway:`` section of the YAML file
named by ``KVINJECT_CONFIG_FILE``, else the defaults (kvinject.settings.resolve,
section "gateway"). Everything is checked here, before a model, a database or
a replica is touched. No FastAPI import here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, List, Mapping, Optional, Sequence

from ..settings import Field, resolve

SECTION = "gateway"
DEFAULT_EMBEDDER = "/var/cache/kvinject/vllm/model/all-MiniLM-L6-v2"

# name, type, default, lo, hi, choices, doc (kvinject.settings.Field)
_ROWS = [
    ("model", str, None, None, None, None,
     "the served model's directory (its tokenizer and chat template build the prompts)"),
    ("replica", str, None, None, None, None,
     "vLLM replica base URLs (http://host:port), comma-separated; the flag repeats"),
    ("db", str, None, None, None, None, "the SQLite file holding users, facts and placements"),
    ("embedder", str, DEFAULT_EMBEDDER, None, None, None,
     "a sentence-transformers directory, or an OpenAI-compatible base URL serving /v1/embeddings"),
    ("embedder_model", str, "", None, None, None, "the model name sent to a /v1/embeddings embedder"),
    ("host", str, "127.0.0.1", None, None, None, "address to listen on"),
    ("port", int, 8000, 1, 65535, None, "port to listen on"),
    ("served_model_name", str, "", None, None, None,
     "the model name answers carry (default: the replicas' model id)"),
    ("system_prompt", str, "You are a helpful assistant.", None, None, None,
     "the system prompt every chat starts with"),
    ("memory_heading", str, "What the user told you before:", None, None, None,
     "the line before the user's memories in the system message"),
    ("default_k", int, 5, 0, 1000, None, "memories retrieved per chat when the request names no k"),
    ("max_k", int, 1000, 0, 100000, None, "the largest k a request may ask for"),
    ("max_fact_tokens", int, 256, 1, 100000, None, "the most tokens one memory may have"),
    ("max_facts_per_add", int, 1000, 1, 100000, None, "the most memories one add may carry"),
    ("max_body_bytes", int, 1 << 20, 1024, 1 << 30, None, "the largest request body accepted"),
    ("health_interval", float, 2.0, 0.1, 3600.0, None, "seconds between health checks of each replica"),
    ("request_timeout", float, 600.0, 1.0, 86400.0, None, "seconds a replica has to answer a request"),
    ("capture_tokens", int, 0, 0, 1000000, None,
     "the most tokens of one capture prompt (0: each replica's max_model_len less 8)"),
    ("log_level", str, "info", None, None, ("debug", "info", "warning", "error"), "log level"),
    ("idle_prefetch_s", float, 300.0, 0.0, 1e9, None,
     "a user's first chat, or the first after this many seconds without one, asks the user's replica "
     "to prefetch the user's memory (0: never)"),
    ("shared_disk", bool, False, None, None, None,
     "the replicas' connectors share one disk_dir: a user moved to another replica loads its memory from the "
     "shared tenant file there instead of being captured again"),
]


@dataclasses.dataclass
class GatewayConfig:
    model: str
    replicas: List[str]
    db: str
    embedder: str = DEFAULT_EMBEDDER
    embedder_model: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""
    system_prompt: str = "You are a helpful assistant."
    memory_heading: str = "What the user told you before:"
    default_k: int = 5
    max_k: int = 1000
    max_fact_tokens: int = 256
    max_facts_per_add: int = 1000
    max_body_bytes: int = 1 << 20
    health_interval: float = 2.0
    request_timeout: float = 600.0
    capture_tokens: int = 0
    log_level: str = "info"
    idle_prefetch_s: float = 300.0
    shared_disk: bool = False

    @property
    def embedder_is_url(self) -> bool:
        return self.embedder.startswith(("http://", "https://"))


FIELDS = [Field(n, t, d, lo=lo, hi=hi, choices=c, doc=doc) for n, t, d, lo, hi, c, doc in _ROWS]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvinject-serve",
        description="An OpenAI-compatible memory service in front of vLLM replicas running the kvinject "
                    "connector (docs/guide/serve.md). Every flag can also come from KVINJECT_GATEWAY_<FLAG> "
                    "or the gateway section of the YAML file named by KVINJECT_CONFIG_FILE.")
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        if f.name == "replica":
            p.add_argument(flag, action="append", metavar="URL", help=f.doc)
            continue
        rng = " (%s)" % f.range_text() if f.range_text() else ""
        # a boolean is parsed as the environment's are (1/0/true/false/yes/no), in load()
        p.add_argument(flag, type=str if f.type is bool else f.type, default=None, choices=f.choices,
                       metavar=f.type.__name__.upper(),
                       help="%s%s; default %s" % (f.doc, rng, f.default if f.default not in (None, "") else "none"))
    return p


def load(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> GatewayConfig:
    """The settings from argv (sys.argv[1:] when None), the environment and
    the file (kvinject.settings.resolve); raises ValueError naming the setting
    that is wrong or missing (argparse exits 2 on a flag of the wrong type)."""
    environ = os.environ if environ is None else environ
    ns = parser().parse_args(argv)
    explicit = {k: v for k, v in vars(ns).items() if v is not None}
    for f in FIELDS:
        if f.type is bool and f.name in explicit:
            explicit[f.name] = f.parse(explicit[f.name], "the command line")
    if "replica" in explicit:
        explicit["replica"] = ",".join(explicit["replica"])
    vals = resolve(SECTION, FIELDS, explicit=explicit, environ=environ, explicit_source="the command line")
    return check(vals)


def check(vals: Mapping[str, Any]) -> GatewayConfig:
    missing = [n for n in ("model", "replica", "db") if not vals.get(n)]
    if missing:
        raise ValueError("missing settings: %s (flags %s)" % (", ".join(missing),
                                                             ", ".join("--" + m for m in missing)))
    reps = []
    for r in str(vals["replica"]).split(","):
        r = r.strip().rstrip("/")
        if not r:
            continue
        if not r.startswith(("http://", "https://")):
            raise ValueError("replica %r: give a base URL, http://host:port" % r)
        if r in reps:
            raise ValueError("replica %s is named twice" % r)
        reps.append(r)
    if not reps:
        raise ValueError("no replica given (--replica URL)")
    model = str(vals["model"])
    if not os.path.isdir(model):
        raise ValueError("--model %s: not a directory (the served model's directory: its tokenizer and chat "
                         "template build the prompts)" % model)
    emb = str(vals.get("embedder") or DEFAULT_EMBEDDER)
    if not emb.startswith(("http://", "https://")) and not os.path.isfile(os.path.join(emb, "modules.json")):
        raise ValueError("--embedder %s: neither a sentence-transformers directory (no modules.json) nor an "
                         "http(s) URL" % emb)
    db = str(vals["db"])
    d = os.path.dirname(os.path.abspath(db))
    if not os.path.isdir(d):
        raise ValueError("--db %s: the directory %s does not exist" % (db, d))
    kw = {f.name: vals[f.name] for f in dataclasses.fields(GatewayConfig)
          if f.name in vals and f.name not in ("model", "replicas", "db", "embedder")}
    cfg = GatewayConfig(model=model, replicas=reps, db=db, embedder=emb, **kw)
    if cfg.default_k > cfg.max_k:
        raise ValueError("default_k %d is above max_k %d" % (cfg.default_k, cfg.max_k))
    return cfg

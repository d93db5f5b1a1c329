"""``python -m kvinject.serve`` / ``kvinject-serve``: the memory gateway.

Settings are checked first (kvinject.serve.config: flags, environment, YAML
file); then the database opens, the tokenizer and the embedder load, and
uvicorn serves. The replicas are checked as the server starts.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import config
    try:
        cfg = config.load(argv)
    except ValueError as e:
        print("kvinject-serve: %s" % e, file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvinject.serve")

    import uvicorn

    from . import embed
    from .app import create_app
    from .db import Database
    from .layout import Layout
    from .memory import Service
    from .metrics import Metrics

    try:
        layout = Layout(cfg.model, cfg.system_prompt, cfg.memory_heading)
    except Exception as e:
        print("kvinject-serve: --model %s: %s" % (cfg.model, e), file=sys.stderr)
        return 2
    try:
        embedder = embed.load(cfg.embedder, cfg.embedder_model, cfg.request_timeout)
    except Exception as e:
        print("kvinject-serve: --embedder %s: %s" % (cfg.embedder, e), file=sys.stderr)
        return 2
    db = Database(cfg.db)
    service = Service(cfg, db, layout, embedder, Metrics())
    log.info("gateway on %s:%d: replicas %s, database %s (%d users, %d memories), header %d tokens",
             cfg.host, cfg.port, ", ".join(cfg.replicas), cfg.db, len(db.users()), db.count_facts(),
             len(layout.header))
    uvicorn.run(create_app(service), host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                timeout_graceful_shutdown=5)
    db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

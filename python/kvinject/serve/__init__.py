"""kvinject.serve: an OpenAI-compatible memory service in front of vLLM
replicas that run the kvinject connector (``python -m kvinject.serve``,
console script ``kvinject-serve``; docs/guide/serve.md).

Users' memories (facts) live in a SQLite file; each user is owned by one live
replica (rendezvous hashing), which holds the user's facts as KV captured by
the connector (the notes encoding: every fact after the memory header and the
facts said before it). A chat embeds the last user message, retrieves the
user's best facts, lays them out in the order they were said and sends the
replica token ids whose [header | facts] prefix is injected from its store.

Modules: ``config`` (settings), ``db`` (SQLite), ``embed`` (the embedder),
``ring`` (rendezvous hashing), ``replicas`` (the replicas: health, requests),
``layout`` (prompt building with the model's chat template), ``memory`` (the
service: captures, placements, chats), ``app`` (FastAPI routes, metrics).
Only ``app`` and ``__main__`` import FastAPI/uvicorn (vLLM's environment has
them); the base package kvinject needs none of this.
"""

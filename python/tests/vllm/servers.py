"""Starting and stopping ``vllm serve`` (the OpenAI-compatible HTTP server) for
the tests of this directory, which run in the vLLM environment of
.ci/install-vllm (launch.py). Standard library only; nothing here imports vLLM.

    from servers import start_vllm_serve, free_port
    srv = start_vllm_serve(C.MODEL, free_port(), {"store_budget_mb": 64}, log_path=path)
    try:
        out = srv.post("/v1/completions", {"model": srv.model, "prompt": [1, 2, 3], "max_tokens": 4})
    finally:
        srv.stop()

``start_vllm_serve`` runs ``<venv>/bin/vllm serve MODEL --host 127.0.0.1 --port
PORT`` (the console script next to this interpreter) in a process group of its
own, its output in ``log_path``, and waits (bounded) until ``GET /health``
answers 200; a server that exits or does not answer in time is stopped and
``ServerError`` carries the end of its log. ``kv_transfer_config`` is the
connector's ``kv_connector_extra_config`` (a dict, ``{}`` for the defaults):
the server then loads ``kvinject.vllm.connector.KVInjectConnector``; ``None``
serves plain vLLM. ``stop()`` ends the whole group (the API server and its
engine-core process): SIGTERM, then SIGKILL after a grace period.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Sequence

# What vLLM's CPU build needs to serve SmolLM2-135M quickly and
# reproducibly on a small machine: no torch.compile or graph capture
# (minutes on 2 cores), bf16, a short context (a small KV cache) and
# blocks of 32 tokens (a multiple of 32: the CPU attention backend's).
CPU_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024", "--block-size", "32",
            "--max-num-seqs", "16"]

HEALTH_TIMEOUT_S = 240.0


class ServerError(RuntimeError):
    """The server did not come up (exited, or no /health in time), or a request failed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The ``vllm`` console script of the environment running this interpreter
    (KVI_VLLM_EXECUTABLE when set: vLLM installed without its scripts)."""
    exe = os.environ.get("KVI_VLLM_EXECUTABLE") or os.path.join(os.path.dirname(sys.executable), "vllm")
    if not os.path.exists(exe):
        raise ServerError("no vllm console script next to %s (run through launch.py, in the environment "
                          ".ci/install-vllm builds)" % sys.executable)
    return exe


def connector_config(extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The --kv-transfer-config JSON object for KVInjectConnector with these settings."""
    return {"kv_connector": "KVInjectConnector", "kv_connector_module_path": "kvinject.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": dict(extra or {})}


class VllmServer:
    """A running ``vllm serve``: ``url`` (http://127.0.0.1:PORT), ``model`` (the
    name requests give), ``process``, ``log_path``; ``stop()``, ``log_text()``,
    ``get`` / ``post`` (JSON over HTTP). Also a context manager (stops on exit)."""

    def __init__(self, process: subprocess.Popen, port: int, model: str, log_path: str, argv: List[str],
                 own_log: bool):
        self.process = process
        self.port = port
        self.url = "http://127.0.0.1:%d" % port
        self.model = model
        self.log_path = log_path
        self.argv = argv
        self._own_log = own_log

    # -- state
    def running(self) -> bool:
        return self.process.poll() is None

    def log_text(self, tail: Optional[int] = None) -> str:
        """The server's output so far (its last ``tail`` characters if given)."""
        try:
            with open(self.log_path, "rb") as f:
                data = f.read()
        except OSError:
            return ""
        text = data.decode("utf-8", "replace")
        return text[-tail:] if tail else text

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> float:
        """Waits until GET /health answers 200; returns the seconds waited. Raises
        ServerError (with the log's end) when the process exits or time runs out."""
        t0 = time.monotonic()
        while True:
            if not self.running():
                raise ServerError("vllm serve exited with status %s before /health answered; its log ends:\n%s"
                                  % (self.process.returncode, self.log_text(6000)))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout:
                raise ServerError("vllm serve: no answer from %s/health in %.0f s; its log ends:\n%s"
                                  % (self.url, timeout, self.log_text(6000)))
            time.sleep(1.0)

    # -- requests
    def request(self, method: str, path: str, body: Any = None, timeout: float = 300.0):
        """(HTTP status, parsed JSON body or text) of one request; HTTP errors are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode("utf-8", "replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get(self, path: str, timeout: float = 60.0):
        """GET path; the parsed JSON body (ServerError unless 200)."""
        return self._ok("GET", path, None, timeout)

    def post(self, path: str, body: Any, timeout: float = 300.0):
        """POST a JSON body; the parsed JSON answer (ServerError unless 200)."""
        return self._ok("POST", path, body, timeout)

    def _ok(self, method, path, body, timeout):
        status, out = self.request(method, path, body, timeout)
        if status != 200:
            raise ServerError("%s %s: HTTP %d: %s" % (method, path, status, out))
        return out

    # -- stopping
    def stop(self, grace: float = 30.0) -> Optional[int]:
        """Ends the server's process group (SIGTERM, SIGKILL after ``grace`` seconds);
        returns the server's exit status. Safe to call twice."""
        pgid = self.process.pid  # start_new_session: the group is the server's pid
        if self.running():
            _killpg(pgid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                _killpg(pgid, signal.SIGKILL)
                self.process.wait(30)
        # the engine core or its workers may outlive the API server: end the group
        _killpg(pgid, signal.SIGKILL)
        return self.process.returncode

    def close(self) -> None:
        """stop(), and remove the log if this module made it."""
        self.stop()
        if self._own_log:
            try:
                os.remove(self.log_path)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_vllm_serve(model: str, port: Optional[int] = None, kv_transfer_config: Optional[Dict[str, Any]] = None,
                     extra_args: Optional[Sequence[str]] = None, log_path: Optional[str] = None, *,
                     env: Optional[Dict[str, str]] = None, wait: bool = True,
                     timeout: float = HEALTH_TIMEOUT_S) -> VllmServer:
    """Starts ``vllm serve MODEL`` on 127.0.0.1:``port`` (free_port() if None) and
    waits for /health (``wait``, at most ``timeout`` seconds; raises ServerError
    after stopping it).

    kv_transfer_config: the connector's settings (kv_connector_extra_config; ``{}``
    for its defaults), or None for plain vLLM. extra_args: vllm serve's options
    after the model (default CPU_ARGS; pass a list to replace them, e.g.
    CPU_ARGS + ["--enable-prefix-caching"]). env: variables to set over this
    process's environment (HF_HUB_OFFLINE=1 and VLLM_CPU_KVCACHE_SPACE=1 unless
    set: launch.py sets both)."""
    port = free_port() if port is None else int(port)
    argv = [vllm_executable(), "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    argv += list(CPU_ARGS if extra_args is None else extra_args)
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(connector_config(kv_transfer_config))]
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix="kvi-vllm-serve-", suffix=".log")
        os.close(fd)
    full_env = dict(os.environ)
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # in-process engine settings the offline tests use do not apply to a server
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    full_env.update(env or {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=full_env, start_new_session=True)
    srv = VllmServer(proc, port, model, log_path, argv, own_log)
    if wait:
        try:
            srv.wait_healthy(timeout)
        except BaseException:
            srv.stop()
            raise
    return srv

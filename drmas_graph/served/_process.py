"""`ServerProcess`: an inference server started as a subprocess in its own process group.

The server's stdout and stderr go to a log file; readiness is polled over HTTP; a timeout or an early exit
raises with the log's tail. `close()` (also run at interpreter exit and on SIGINT/SIGTERM) kills the whole
process group, so the server's own children (vLLM's engine core, SGLang's scheduler) never outlive it.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence

import httpx

from drmas_graph.served._errors import ServerStartError

__all__ = ["ServerProcess", "free_port", "server_env", "owned_flag", "LAUNCH_FLAGS"]

PROCESS_GROUP_ENV = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "CROSS_RANK", "CROSS_SIZE",
    "LOCAL_SIZE",
})
"""Variables that torchrun, the deepspeed launcher or the trainer itself (a single-process DeepSpeed group)
set for this process's torch.distributed group. A server inheriting them would try to join that group
(vLLM and SGLang start their own), e.g. bind the trainer's MASTER_PORT."""
PROCESS_GROUP_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_")
"""Prefixes of launcher variables with the same meaning (torch elastic, Open MPI ranks as DeepSpeed reads them)."""

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()
_HOOKS_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched server: `base` (default os.environ) without this process's process-group
    variables (`PROCESS_GROUP_ENV`, `PROCESS_GROUP_PREFIXES`), plus `extra` (which may set any of them again)."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items()
           if k not in PROCESS_GROUP_ENV and not k.startswith(PROCESS_GROUP_PREFIXES)}
    env.update(extra or {})
    return env


def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.close()


def _install_exit_hooks() -> None:
    """atexit always; SIGINT/SIGTERM only from the main thread and only chaining the previous handler."""
    global _HOOKS_INSTALLED
    with _HOOKS_LOCK:
        if _HOOKS_INSTALLED:
            return
        _HOOKS_INSTALLED = True
        atexit.register(_stop_all)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous):
                _stop_all()
                if callable(previous):
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            signal.signal(sig, handler)


class ServerProcess:
    """A running server: `url`, `pid`, `log_path`; `close()` stops it and its children.

    Args:
        argv: the command line.
        url: base URL the server will listen on (http://host:port).
        ready_path: GET path that returns 200 once the server can serve (polled every `poll_s`).
        env: extra environment variables, on top of this process's environment minus its torch.distributed
            variables (`server_env`: MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, ... never leak in).
        log_path: where stdout+stderr go (default: a temporary file, kept after close for post-mortems).
    """

    def __init__(self, argv: Sequence[str], *, url: str, ready_path: str, env: dict[str, str] | None = None,
                 log_path: str | None = None, name: str = "server") -> None:
        self.argv = list(argv)
        self.url = url.rstrip("/")
        self.ready_path = ready_path
        self.name = name
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"drmas-{name}-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        _install_exit_hooks()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=server_env(env), start_new_session=True)
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Block until GET `ready_path` returns 200; return the seconds waited. Raise `ServerStartError`."""
        start = time.monotonic()
        deadline = start + timeout_s
        with httpx.Client(timeout=10.0) as client:
            while True:
                if not self.alive():
                    self.close()
                    raise ServerStartError(
                        f"{self.name} exited with code {self.proc.returncode} before it was ready "
                        f"({' '.join(self.argv)}); log {self.log_path} ends with:\n{self.log_tail()}")
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.close()
                    raise ServerStartError(
                        f"{self.name} at {self.url} was not ready after {timeout_s:.0f} s (GET {self.ready_path}); a "
                        f"model that takes longer to load needs a longer ready_timeout_s "
                        f"(models.<name>.serve.ready_timeout_s in a config); log {self.log_path} ends with:\n"
                        f"{self.log_tail()}")
                time.sleep(poll_s)

    def close(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; idempotent."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # the leader may be gone while children of its group linger: kill the group once more
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()
        _LIVE.discard(self)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited({self.proc.returncode})"
        return f"ServerProcess({self.name!r}, url={self.url!r}, pid={self.pid}, {state})"


LAUNCH_FLAGS = {
    "vllm": {"--model": "from `path`", "--host": "127.0.0.1", "--port": "a free port",
             "--dtype": "from models.<name>.dtype", "--logprobs-mode": "processed_logprobs: the logprobs it records",
             "--enable-lora": "from models.<name>.lora", "--max-loras": "from models.<name>.lora",
             "--max-lora-rank": "from models.<name>.lora"},
    "sglang": {"--model-path": "from `path`", "--host": "127.0.0.1", "--port": "a free port",
               "--dtype": "from models.<name>.dtype", "--weight-version": "the policy version it serves"},
}
"""The flags `launch_vllm` (with `vllm_launch_kwargs`) and `launch_sglang` set from the config, and from what: a
launched server's `models.<name>.serve.args` may not set them. (`--max-model-len` is launch_vllm's too, but a later
one overrides it.)"""


def owned_flag(engine: str, arg: str) -> str | None:
    """What sets `arg`'s flag (`--flag` or `--flag=value`; vLLM reads `--flag_name` as `--flag-name`) when
    drmas-graph launches `engine` ('vllm' or 'sglang') itself, else None (the flag is the user's to give)."""
    return LAUNCH_FLAGS[engine].get(arg.split("=", 1)[0].replace("_", "-"))

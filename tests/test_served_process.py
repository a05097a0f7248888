"""Launched servers never inherit this process's torch.distributed variables (a DeepSpeed group set RANK,
MASTER_PORT, ... in os.environ; vLLM/SGLang would try to join it)."""

import json
import sys

from drmas_graph.served import free_port
from drmas_graph.served._process import ServerProcess, server_env

LEAKY = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3",
         "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x", "OMPI_COMM_WORLD_RANK": "3"}

# dumps its environment to stdout (the server log), then answers GET /health
SERVER = """
import http.server, json, os, sys
print("ENV " + json.dumps(dict(os.environ)), flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_env_drops_process_group_variables_and_keeps_the_rest():
    env = server_env({"VLLM_SERVER_DEV_MODE": "1"}, base={**LEAKY, "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}
    assert server_env({"RANK": "0"}, base=LEAKY) == {"RANK": "0"}  # what the caller sets explicitly is kept


def test_a_launched_server_does_not_inherit_them(monkeypatch, tmp_path):
    for key, value in LEAKY.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DRMAS_TEST_KEEP", "yes")
    port = free_port()
    server = ServerProcess([sys.executable, "-c", SERVER, str(port)], url=f"http://127.0.0.1:{port}",
                           ready_path="/health", env={"EXTRA": "1"}, log_path=str(tmp_path / "server.log"))
    try:
        server.wait_ready(60, poll_s=0.1)
    finally:
        server.close()
    line = next(x for x in (tmp_path / "server.log").read_text().splitlines() if x.startswith("ENV "))
    env = json.loads(line[4:])
    assert not set(LEAKY) & set(env)
    assert env["DRMAS_TEST_KEEP"] == "yes" and env["EXTRA"] == "1"

"""A strict protocol double of an SGLang server (native API), sampling from a real tiny model.

It speaks the documented SGLang 0.5.x protocol (see /work/shared/reference/rollout-engines.md):

- `POST /generate`: requires `input_ids` (one prompt; `text` is refused, as with `--skip-tokenizer-init`);
  `sampling_params` may hold documented keys only (an unknown key is a 400, as in SGLang); with
  `return_logprob` the reply has `meta_info.output_token_logprobs` entries `[logprob, token_id, null]`;
  `output_ids` keep the stop token; `finish_reason` is `{"type":"stop","matched":id|str}`,
  `{"type":"length","length":N}` or `{"type":"abort","message":...}`; `meta_info.weight_version`.
- `POST /pause_generation` (body must be a JSON object: `{}` or `{"mode": "abort"|"retract"|"in_place"}`):
  in-flight requests end with an abort; new ones wait until `POST /continue_generation` (JSON object body).
- `POST /update_weights_from_disk {model_path, weight_version, ...}`: reloads the model from the folder.
- `GET /model_info`, `GET /health`, `GET /health_generate`.

Sampling is real: tokens are drawn from the model loaded from `model_path`, logprobs are
log_softmax(logits / T) at the sampled token (greedy at T=0, logprobs at T=1). Every sampled response is
appended to `self.sampled` so tests can compare what the client recorded with what the server produced.

Test hooks: `abort_next` (the next N generations end with an abort), `ignore_weight_version` (updates keep
the old version: a mismatching server), `step_delay_s` (slow decoding), `stop()` (a dead server).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from drmas_graph.engine.transformers_policy import sample_token
from drmas_graph.grammar import Grammars, mask_logits
from drmas_graph.types import SamplingParams

SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "no_stop_trim", "n", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "sampling_seed", "json_schema", "regex", "ebnf", "spaces_between_special_tokens",
    "stop_regex", "custom_params", "structural_tag",
}
UPDATE_KEYS = {"model_path", "load_format", "weight_version", "abort_all_requests", "flush_cache",
               "is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step"}


class _BadRequest(Exception):
    pass


class SGLangDouble:
    """Start with `SGLangDouble(model_path).start()`; `url` is its base URL; `stop()` shuts it down."""

    def __init__(self, model_path: str, *, weight_version: str = "default", host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.host = host
        self.port = port
        self.model_path = model_path
        self.weight_version = weight_version
        self.sampled: list[dict[str, Any]] = []
        self.requests: list[tuple[str, Any]] = []
        self.abort_next = 0
        self.ignore_weight_version = False
        self.step_delay_s = 0.0
        self.updates = 0
        self._model_lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._abort_epoch = 0
        self._load(model_path)
        self._server: ThreadingHTTPServer | None = None

    # ---- model ------------------------------------------------------------------------------
    def _load(self, path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        with self._model_lock:
            self.model, self.tokenizer = model, tokenizer

    @torch.inference_mode()
    def _sample(self, input_ids: list[int], sp: dict[str, Any]) -> tuple[list[int], list[float], dict]:
        params = SamplingParams(temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                                top_k=int(sp.get("top_k", -1)), max_new_tokens=int(sp.get("max_new_tokens", 128)))
        seed = int(sp["sampling_seed"]) if "sampling_seed" in sp else int(torch.randint(0, 2**62, (1,)))
        stop_ids = set(sp.get("stop_token_ids") or ()) | {self.tokenizer.eos_token_id}
        stops = sp.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        epoch = self._abort_epoch
        ids: list[int] = []
        lps: list[float] = []
        grammar = self._grammars().matcher(sp["structural_tag"]) if sp.get("structural_tag") else None
        for _ in range(params.max_new_tokens):
            if self._abort_epoch != epoch or self.abort_next > 0:
                if self.abort_next > 0:
                    self.abort_next -= 1
                return ids, lps, {"type": "abort", "message": "Abort in waiting queue", "status_code": 503,
                                  "err_type": None}
            with self._model_lock:
                logits = self.model(input_ids=torch.tensor([input_ids + ids])).logits[0, -1]
            if grammar is not None:  # SGLang masks the logits before its sampler: the logprobs are the masked ones
                bitmask = self._grammars().bitmask(1)
                grammar.fill(bitmask, 0)
                logits = mask_logits(logits[None], bitmask)[0]
            tok, lp = sample_token(logits, params, seed, len(ids))
            if grammar is not None:
                assert grammar.accept(tok)
            ids.append(tok)
            lps.append(lp)
            if tok in stop_ids:
                return ids, lps, {"type": "stop", "matched": tok}
            text = self.tokenizer.decode(ids)
            for s in stops:
                if s in text:
                    return ids, lps, {"type": "stop", "matched": s}
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
        return ids, lps, {"type": "length", "length": len(ids)}

    def _grammars(self) -> Grammars:
        """The grammars of the served tokenizer (xgrammar, as SGLang's default backend compiles them)."""
        if getattr(self, "_grammar_cache", None) is None:
            self._grammar_cache = Grammars(self.tokenizer, self.model.get_output_embeddings().weight.shape[0],
                                           [self.tokenizer.eos_token_id])
        return self._grammar_cache

    # ---- endpoints --------------------------------------------------------------------------
    def _generate(self, body: dict) -> dict:
        if "text" in body:
            raise _BadRequest("this server runs with --skip-tokenizer-init: send input_ids, not text")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise _BadRequest("Either text, input_ids or input_embeds should be provided (one list of ints)")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise _BadRequest("sampling_params must be a dict for a single prompt")
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:
            raise _BadRequest(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
        if sp.get("n", 1) != 1:
            raise _BadRequest("the double supports n=1 only")
        self._running.wait()
        out, lps, finish = self._sample(ids, sp)
        meta: dict[str, Any] = {"id": f"rid-{len(self.sampled)}", "finish_reason": finish,
                                "prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0,
                                "weight_version": self.weight_version, "e2e_latency": 0.0}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs_length"] = len(out)
        self.sampled.append({"input_ids": ids, "output_ids": out, "logprobs": lps, "finish_reason": finish,
                             "weight_version": self.weight_version})
        return {"text": self.tokenizer.decode(out, skip_special_tokens=True), "output_ids": out, "meta_info": meta}

    @staticmethod
    def _require_object(body: Any, path: str, allowed: set[str]) -> None:
        if not isinstance(body, dict):
            raise _BadRequest(f"{path} needs a JSON object body (send {{}})")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise _BadRequest(f"{path}: unknown field(s) {unknown}")

    def _pause(self, body: Any) -> dict:
        self._require_object(body, "/pause_generation", {"mode"})
        if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
            raise _BadRequest(f"unknown pause mode {body.get('mode')!r}")
        self._running.clear()
        self._abort_epoch += 1
        return {"status": "ok"}

    def _continue(self, body: Any) -> dict:
        self._require_object(body, "/continue_generation", {"torch_empty_cache"})
        self._running.set()
        return {"status": "ok"}

    def _update(self, body: Any) -> tuple[int, dict]:
        self._require_object(body, "/update_weights_from_disk", UPDATE_KEYS)
        if "model_path" not in body:
            raise _BadRequest("/update_weights_from_disk requires model_path")
        try:
            self._load(body["model_path"])
        except Exception as exc:  # noqa: BLE001 - reported like SGLang: success false
            return 400, {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
        self.updates += 1
        self.model_path = body["model_path"]
        if body.get("weight_version") is not None and not self.ignore_weight_version:
            self.weight_version = str(body["weight_version"])
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "weight_version": self.weight_version, "load_format": "auto", "served_model_name": self.model_path,
                "preferred_sampling_params": None, "architectures": list(self.model.config.architectures or [])}

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((f"{method} {path}", body))
        route = (method, path)
        if route in (("GET", "/health"), ("GET", "/health_generate")):
            return 200, None
        if route == ("GET", "/model_info"):
            return 200, self._model_info()
        if route == ("POST", "/generate"):
            return 200, self._generate(body)
        if route == ("POST", "/pause_generation"):
            return 200, self._pause(body)
        if route == ("POST", "/continue_generation"):
            return 200, self._continue(body)
        if route == ("POST", "/update_weights_from_disk"):
            return self._update(body)
        return 404, {"detail": "Not Found"}

    # ---- server -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "start() the double first"
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> SGLangDouble:
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                    if method == "POST" and body is None:
                        raise _BadRequest("a JSON body is required")
                    status, reply = double.handle(method, self.path.split("?")[0], body)
                except (_BadRequest, json.JSONDecodeError) as exc:
                    status, reply = 400, {"error": {"message": str(exc)}}
                data = b"" if reply is None else json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="sglang-double", daemon=True).start()
        return self

    def stop(self) -> None:
        """Shut down: the port stops accepting connections (a dead server)."""
        if self._server is not None:
            self._running.set()
            self._server.shutdown()
            self._server.server_close()


def main() -> None:
    """`python -m tests.sglang_double --model-path DIR --port N [--weight-version V]`: serve until killed."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--weight-version", default="default")
    args, _ = ap.parse_known_args()
    SGLangDouble(args.model_path, weight_version=args.weight_version, host=args.host, port=args.port).start()
    threading.Event().wait()


if __name__ == "__main__":
    main()

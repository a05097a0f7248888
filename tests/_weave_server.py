"""A small in-memory Weave trace server for tests: the routes the real `weave.WeaveClient` uses to log
calls, objects, tables, files and feedback, and to read calls and feedback back.

It implements the trace server interface in process (the object a `WeaveClient` is built on; the HTTP
client `RemoteHTTPTraceServer` implements the same interface over the network), so a test runs the real
client code path -- op saving, call start/end with summaries and usage roll-up, threads, feedback,
`EvaluationLogger` -- with no network and no `weave.init`. Routes it lacks raise AttributeError, which
the client treats as "not supported" where it probes (`hasattr`), and which fails loudly elsewhere.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from weave.trace_server_bindings.models import FileContentReadRes
from weave.vendor.weave_server_sdk.types import (
    CallQueryStatsResponse,
    CallStartResponse,
    FeedbackCreateResponse,
    FeedbackQueryResponse,
    FileCreateResponse,
    ObjectCreateResponse,
    ObjectReadResponse,
    TableCreateResponse,
)
from weave.vendor.weave_server_sdk.types.call_read_response import Call


def _digest(value: Any) -> str:
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:32]


def _utc(value: Any) -> datetime.datetime | None:
    if value is None or isinstance(value, datetime.datetime):
        return value
    return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))


class InMemoryTraceServer:
    """Calls, objects, tables, files and feedback in dicts; thread-safe (the client writes from its pool)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, dict[str, Any]] = {}
        """call id -> the call's fields (start merged with end)."""
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        """(object_id, digest) -> the object request."""
        self.files: dict[str, bytes] = {}
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.feedback: list[dict[str, Any]] = []
        self.requests: list[str] = []
        """Route names in the order they were called."""
        self._order = itertools.count()

    def _log(self, route: str) -> None:
        with self.lock:
            self.requests.append(route)

    # -- writing ---------------------------------------------------------------------------------
    def call_start(self, req: dict[str, Any]) -> CallStartResponse:
        self._log("call_start")
        start = dict(req["start"])
        start["started_at"] = _utc(start["started_at"])
        start["_order"] = next(self._order)
        with self.lock:
            self.calls.setdefault(start["id"], {}).update(start)
        return CallStartResponse(id=start["id"], trace_id=start["trace_id"])

    def call_end(self, req: dict[str, Any]) -> dict[str, Any]:
        self._log("call_end")
        end = dict(req["end"])
        with self.lock:
            call = self.calls.setdefault(end["id"], {})
            call.update(ended_at=_utc(end["ended_at"]), exception=end.get("exception"), output=end.get("output"),
                        summary=end.get("summary"))
        return {}

    def obj_create(self, req: dict[str, Any]) -> ObjectCreateResponse:
        self._log("obj_create")
        obj = req["obj"]
        digest = _digest(obj["val"])
        with self.lock:
            self.objects[(obj["object_id"], digest)] = dict(obj, created_at=datetime.datetime.now(datetime.UTC))
        return ObjectCreateResponse(digest=digest, object_id=obj["object_id"])

    def obj_read(self, req: dict[str, Any]) -> ObjectReadResponse:
        self._log("obj_read")
        with self.lock:
            if req["digest"] == "latest":
                matches = [o for (oid, _), o in self.objects.items() if oid == req["object_id"]]
                obj, digest = matches[-1], _digest(matches[-1]["val"])
            else:
                obj, digest = self.objects[(req["object_id"], req["digest"])], req["digest"]
        return ObjectReadResponse(obj={
            "object_id": obj["object_id"], "project_id": obj["project_id"], "digest": digest, "val": obj["val"],
            "created_at": obj["created_at"], "is_latest": 1, "kind": "object", "version_index": 0,
            "base_object_class": obj.get("builtin_object_class"),
        })

    def file_create(self, req: dict[str, Any]) -> FileCreateResponse:
        self._log("file_create")
        file = req["file"]
        content = file[1] if isinstance(file, tuple) else file
        content = content.read() if hasattr(content, "read") else content
        digest = _digest(bytes(content))
        with self.lock:
            self.files[digest] = bytes(content)
        return FileCreateResponse(digest=digest)

    def file_content_read(self, req: dict[str, Any]) -> FileContentReadRes:
        self._log("file_content_read")
        return FileContentReadRes(content=self.files[req["digest"]])

    def table_create(self, req: dict[str, Any]) -> TableCreateResponse:
        self._log("table_create")
        rows = list(req["table"]["rows"])
        digest = _digest(rows)
        with self.lock:
            self.tables[digest] = rows
        return TableCreateResponse(digest=digest, row_digests=[_digest(r) for r in rows])

    def feedback_create(self, req: dict[str, Any]) -> FeedbackCreateResponse:
        self._log("feedback_create")
        row = dict(req, id=uuid.uuid4().hex, created_at=datetime.datetime.now(datetime.UTC), wb_user_id="test-user")
        with self.lock:
            self.feedback.append(row)
        return FeedbackCreateResponse(id=row["id"], created_at=row["created_at"], payload=row["payload"],
                                      wb_user_id=row["wb_user_id"])

    # -- reading ---------------------------------------------------------------------------------
    def _matching_calls(self, project_id: str, flt: dict[str, Any] | None) -> list[dict[str, Any]]:
        flt = flt or {}
        with self.lock:
            calls = [dict(c) for c in self.calls.values() if c.get("project_id") == project_id]
        keys = {"call_ids": "id", "parent_ids": "parent_id", "trace_ids": "trace_id", "thread_ids": "thread_id",
                "turn_ids": "turn_id"}
        for key, field in keys.items():
            if flt.get(key) is not None:
                calls = [c for c in calls if c.get(field) in set(flt[key])]
        if flt.get("op_names") is not None:
            wanted = set(flt["op_names"])
            calls = [c for c in calls if c["op_name"] in wanted or c["op_name"].split("/op/")[-1].split(":")[0] in wanted]
        if flt.get("trace_roots_only"):
            calls = [c for c in calls if c.get("parent_id") is None]
        unknown = set(flt) - set(keys) - {"op_names", "trace_roots_only"}
        if any(flt[k] for k in unknown):
            raise NotImplementedError(f"in-memory trace server: filter keys {sorted(unknown)}")
        return sorted(calls, key=lambda c: c["_order"])  # arrival order: the client's thread pool may reorder starts

    def calls_query_stream(self, req: dict[str, Any]) -> Iterator[Call]:
        self._log("calls_query_stream")
        if req.get("query"):
            raise NotImplementedError("in-memory trace server: calls query expressions")
        calls = self._matching_calls(req["project_id"], req.get("filter"))
        for sort in req.get("sort_by") or []:
            calls.sort(key=lambda c: c.get(sort["field"]) or 0, reverse=sort["direction"] == "desc")
        offset = req.get("offset") or 0
        limit = req.get("limit")
        calls = calls[offset: None if limit is None else offset + limit]
        for c in calls:
            summary = dict(c.get("summary") or {})
            if req.get("include_feedback"):
                ref_tail = f"/call/{c['id']}"
                with self.lock:
                    fb = [f for f in self.feedback if f["weave_ref"].endswith(ref_tail)]
                summary["weave"] = {**summary.get("weave", {}), "feedback": fb}
            yield Call(id=c["id"], project_id=c["project_id"], op_name=c["op_name"], trace_id=c["trace_id"],
                       parent_id=c.get("parent_id"), thread_id=c.get("thread_id"), turn_id=c.get("turn_id"),
                       started_at=c["started_at"], ended_at=c.get("ended_at"), attributes=c.get("attributes") or {},
                       inputs=c.get("inputs") or {}, output=c.get("output"), exception=c.get("exception"),
                       summary=summary, display_name=c.get("display_name"))

    def calls_query_stats(self, req: dict[str, Any]) -> CallQueryStatsResponse:
        self._log("calls_query_stats")
        return CallQueryStatsResponse(count=len(self._matching_calls(req["project_id"], req.get("filter"))))

    def feedback_query(self, req: dict[str, Any]) -> FeedbackQueryResponse:
        self._log("feedback_query")
        expr = (req.get("query") or {}).get("$expr", {})
        ref = expr.get("$eq", [None, {}])[1].get("$literal") if "$eq" in expr else None
        with self.lock:
            rows = [dict(f) for f in self.feedback if f["project_id"] == req["project_id"]
                    and (ref is None or f["weave_ref"] == ref)]
        return FeedbackQueryResponse(result=rows, total_count=len(rows))


def make_client(server: InMemoryTraceServer, entity: str = "test-entity", project: str = "drmas-test") -> Any:
    """The real `WeaveClient` on `server` (no `weave.init`, no network, no login)."""
    from weave.trace.weave_client import WeaveClient

    return WeaveClient(entity, project, server, ensure_project_exists=False)

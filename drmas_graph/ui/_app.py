"""The web app: a router over a few GET pages, and the stdlib HTTP server that serves it.

Why no web framework: the app is local, read-only and for one user, with a handful of GET routes and no forms
that write; Python's ``http.server`` (threaded) serves that with nothing to install, and Jinja2 (autoescaping on for
every template) renders the pages. Charts are SVG drawn on the server (`_charts`; smoothing, step ranges and
enlarging are query parameters and links), so the pages need no script at all: the Content-Security-Policy
forbids every script, which also makes an escaping mistake inert. Every bad input is a styled 4xx page, every
fault a styled 500 page without a traceback.
"""

from __future__ import annotations

import errno
import ipaddress
import mimetypes
import shlex
import sys
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from drmas_graph.errors import ConfigError, DrmasError, EpisodeNotFoundError, StoreNotFoundError
from drmas_graph.ui import _answers, _exports, _pages
from drmas_graph.ui._charts import line_chart
from drmas_graph.ui._data import OUTCOMES, PAGE_SIZES, PHASES, SORTS, EpisodeQuery, Run, open_runs

__all__ = ["UiApp", "Response", "make_server", "is_loopback"]

_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
"""Sent with every response: no script may run, nothing loads from elsewhere, no framing."""

_STATIC = ("ui.css",)
"""The only files under /static/ (read from the package, never from a path in the URL)."""


@dataclass(frozen=True)
class Response:
    """What a route returns."""

    status: int
    """HTTP status."""
    body: bytes
    """The body."""
    content_type: str = "text/html; charset=utf-8"
    """Its media type."""
    filename: str | None = None
    """Sent as an attachment with this name (exports); None: shown."""


class UiApp:
    """The pages of the runs given, as a function of (path, query parameters) -> `Response`.

    ``graph``: the compiled graph (or the ``module:attr`` text naming it) that the Replay button replays
    episodes into; None hides the button.
    """

    def __init__(self, runs: Mapping[str, Run] | Sequence[str | Path], *, graph: Any = None, graph_spec: str | None = None):
        self.runs: dict[str, Run] = dict(runs) if isinstance(runs, Mapping) else open_runs(runs)
        """Runs by URL name."""
        self.graph = graph
        """What Replay replays into (None: no replay)."""
        self.graph_spec = graph_spec
        """How the graph was named on the command line (shown in the terminal equivalent)."""
        self._replay_lock = threading.Lock()  # one replay at a time: replays install call interception
        self._env = Environment(loader=PackageLoader("drmas_graph.ui", "templates"),
                                autoescape=select_autoescape(default=True, default_for_string=True),
                                undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self._env.globals.update(url=_url, fmt=_fmt, outcomes=list(OUTCOMES), sorts=list(SORTS),
                                 page_sizes=PAGE_SIZES, phases=PHASES, runs=self.runs, counts=_pages.counts)
        self._static = {name: resources.files("drmas_graph.ui").joinpath("static", name).read_bytes()
                        for name in _STATIC}

    # -- routing ---------------------------------------------------------------------------------------------

    def handle(self, path: str, params: Mapping[str, Sequence[str]]) -> Response:
        """Answer one GET request (`path` still percent-encoded, `params` parsed from the query string)."""
        parts = [urllib.parse.unquote(p) for p in path.split("/") if p]
        one = {k: v[-1] for k, v in params.items() if v}
        try:
            return self._route(parts, one, params)
        except (EpisodeNotFoundError, StoreNotFoundError) as e:
            return self.error(HTTPStatus.NOT_FOUND, str(e))
        except ConfigError as e:
            return self.error(HTTPStatus.BAD_REQUEST, str(e))
        except DrmasError as e:  # a store that cannot be read (corrupt, a newer schema, ...): the run's fault
            return self.error(HTTPStatus.INTERNAL_SERVER_ERROR, str(e))

    def fault(self, error: BaseException) -> Response:
        """The styled 500 page of an unexpected exception: its type and message, never a traceback."""
        return self.error(HTTPStatus.INTERNAL_SERVER_ERROR,
                           f"the UI failed on this page ({type(error).__name__}: {error}); the server log has "
                           "the request")

    def _route(self, parts: list[str], one: dict[str, str], params: Mapping[str, Sequence[str]]) -> Response:
        if not parts:
            return self._runs_page(list(params.get("run", [])), one)
        if parts == ["chart"]:
            return self._chart_page(list(params.get("run", [])), one)
        if parts[0] == "static" and len(parts) == 2 and parts[1] in self._static:
            kind = mimetypes.guess_type(parts[1])[0] or "application/octet-stream"
            return Response(200, self._static[parts[1]], kind)
        if parts[0] == "runs" and len(parts) >= 2 and parts[1] in self.runs:
            run = self.runs[parts[1]]
            rest = parts[2:]
            if rest[:1] != ["export"] and run.not_written() is not None:
                return self._page("waiting.html", run=run, message=run.not_written(), refresh=run.waiting())
            if rest == ["episodes"]:
                return self._episodes_page(run, one)
            if rest == ["answers"]:
                return self._page("answers.html", run=run, **_answers.answers_view(run, one))
            if len(rest) == 2 and rest[0] == "export":
                return self._export(run, rest[1], one)
            if rest == ["group"]:
                return self._group_page(run, one.get("id", ""))
            if len(rest) == 2 and rest[0] == "episodes":
                return self._episode_page(run, rest[1])
            if len(rest) == 3 and rest[0] == "episodes" and rest[2] == "replay":
                return self._replay_page(run, rest[1])
        return self.error(HTTPStatus.NOT_FOUND, "no such page")

    # -- pages -----------------------------------------------------------------------------------------------

    def _selected(self, chosen: list[str]) -> list[Run]:
        unknown = [name for name in chosen if name not in self.runs]
        if unknown:
            raise ConfigError(f"unknown run {unknown[0]!r}; runs: {', '.join(self.runs)}")
        return [self.runs[name] for name in chosen] or list(self.runs.values())

    def _runs_page(self, chosen: list[str], one: dict[str, str]) -> Response:
        selected = self._selected(chosen)
        options = _pages.ChartOptions.from_params(one)

        def link(pattern: str) -> str:
            return _url("/chart", [("metric", pattern), *(("run", name) for name in chosen),
                                   *options.params().items()])

        colours = _colours(self.runs, selected)
        first, rest = _pages.run_charts(selected, colours, options, link)
        evals = {run.name: _pages.eval_rows(run) for run in selected}
        steps = {run.name: sum(1 for r in run.metrics() if "episodes" in r) for run in selected}
        malformed = {run.name: run.malformed_metrics() for run in selected}
        waiting = {r.name: r.not_written() for r in selected if r.waiting()}
        return self._page("runs.html", selected=[r.name for r in selected], chosen=chosen, colours=colours,
                          first=first, rest=rest, waiting=waiting, refresh=bool(waiting),
                          evals=evals, steps=steps, malformed=malformed, options=options,
                          tensorboard={r.name: f"tensorboard --logdir {shlex.quote(str(r.folder / 'tensorboard'))}"
                                       for r in selected if (r.folder / "tensorboard").is_dir()})

    def _chart_page(self, chosen: list[str], one: dict[str, str]) -> Response:
        selected = self._selected(chosen)
        options = _pages.ChartOptions.from_params(one)
        pattern = one.get("metric", "")
        series = _pages.chart_series(selected, _colours(self.runs, selected), options).get(pattern)
        if not series:
            return self.error(HTTPStatus.NOT_FOUND, f"no metric {pattern!r} in run(s) "
                                                    f"{', '.join(r.name for r in selected)}")
        chart = line_chart(_pages.chart_title(pattern), series, smooth=options.smooth, size="large")
        return self._page("chart.html", chart=chart, pattern=pattern, chosen=chosen, options=options,
                          back=_url("/", [*(("run", name) for name in chosen), *options.params().items()]))

    def _episodes_page(self, run: Run, one: dict[str, str]) -> Response:
        query = EpisodeQuery.from_params(one)
        page = run.episode_page(query)
        return self._page("episodes.html", run=run, page=page, query=query, choices=run.choices(),
                          cli=_list_command(run, query, page.phase))

    def _export(self, run: Run, name: str, one: dict[str, str]) -> Response:
        what, _, kind = name.partition(".")
        if what not in ("metrics", "episodes") or kind not in ("csv", "json"):
            return self.error(HTTPStatus.NOT_FOUND, f"no export {name!r}: metrics.csv, metrics.json, "
                                                    "episodes.csv or episodes.json")
        if what == "metrics":
            records = run.metrics()
        else:
            records = _exports.episode_records(run, EpisodeQuery.from_params(one))
        body = _exports.to_csv(records) if kind == "csv" else _exports.to_json(records)
        media = "text/csv; charset=utf-8" if kind == "csv" else "application/json"
        return Response(200, body, media, filename=f"{run.name}-{name}")

    def _group_page(self, run: Run, group_id: str) -> Response:
        if not group_id:
            raise ConfigError("parameter id: give a group id (the episode list links to each episode's group)")
        view = _pages.group_view(run, group_id)
        if not view["episodes"]:
            return self.error(HTTPStatus.NOT_FOUND, f"run {run.name!r} has no group {group_id!r} (group ids match "
                                                    "exactly: copy one from the episode list)")
        return self._page("group.html", run=run, **view)

    def _episode_page(self, run: Run, episode_id: str) -> Response:
        store = run.store()
        summary = store.summary(episode_id)
        episode = store.load_episode(episode_id)
        return self._page("episode.html", run=run, summary=summary, can_replay=self.graph is not None,
                          **_pages.episode_view(run, episode))

    def _replay_page(self, run: Run, episode_id: str) -> Response:
        if self.graph is None:
            raise ConfigError("replay needs a graph: start the UI with --graph module:attr")
        episode = run.store().load_episode(episode_id)
        with self._replay_lock:
            view = _pages.replay_view(self.graph, episode)
        return self._page("replay.html", run=run, episode=episode, graph_spec=self.graph_spec or "GRAPH", **view)

    def _page(self, template: str, **values: Any) -> Response:
        body = self._env.get_template(template).render(**values)
        return Response(200, body.encode())

    def error(self, status: HTTPStatus, message: str) -> Response:
        """The styled error page (`status`, its phrase, `message` as text)."""
        body = self._env.get_template("error.html").render(status=int(status), phrase=status.phrase, message=message)
        return Response(int(status), body.encode())

    def close(self) -> None:
        for run in self.runs.values():
            run.close()


# -- template helpers ----------------------------------------------------------------------------------------


def _colours(runs: Mapping[str, Run], selected: Sequence[Run]) -> dict[str, int]:
    """A run's colour on a page: its place among the runs shown, in the order the UI was given them (whatever the
    URL's order; the same in every chart of the page), so runs overlaid never share one while at most
    len(PALETTE) are shown (a place among every run given did: the first and the ninth)."""
    shown = {run.name for run in selected}
    return {name: i for i, name in enumerate(n for n in runs if n in shown)}


def _url(path: str, params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None) -> str:
    """A link: path segments are percent-encoded by the caller with `quote` (ids are hex), parameters here."""
    pairs = params.items() if isinstance(params, Mapping) else params or ()
    query = urllib.parse.urlencode([(k, v) for k, v in pairs if v is not None])
    return path + ("?" + query if query else "")


def _fmt(value: Any, digits: int = 4) -> str:
    """A cell: '–' for None, floats to `digits` significant digits."""
    if value is None:
        return "–"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _list_command(run: Run, query: EpisodeQuery, phase: str) -> str:
    """The `drmas-graph traces list` line that prints this list (every episode, not one page)."""
    line = f"drmas-graph traces list {shlex.quote(str(run.store_path))}"
    flags = (("--phase", None if phase == "all" else phase), ("--step", query.step), ("--agent", query.agent),
             ("--task", query.task), ("--group", query.group), ("--outcome", query.outcome),
             ("--min-reward", query.min_reward), ("--max-reward", query.max_reward), ("--reply", query.reply),
             ("--sort", None if query.sort == "created" else query.sort))
    for flag, value in flags:
        if value is not None:
            line += f" {flag} {shlex.quote(str(value))}"
    return line + (" --desc" if query.desc else "")


# -- serving -------------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        app = self.server.app
        if self.server.loopback_only and not self._host_ok():
            self._send(app.error(HTTPStatus.BAD_REQUEST, "unexpected Host header (this server answers localhost "
                                                         "only): open it as http://127.0.0.1:PORT/"))
            return
        try:
            url = urllib.parse.urlsplit(self.path)
            response = app.handle(url.path, urllib.parse.parse_qs(url.query))
        except Exception as e:  # noqa: BLE001 (any fault: a styled 500, one log line, no traceback to the browser)
            self.log_message("%s failed: %s: %s", self.path, type(e).__name__, e)
            response = app.fault(e)
        self._send(response)

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def _read_only(self) -> None:
        self.close_connection = True  # its body is never read
        self._send(self.server.app.error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command}: the UI is read-only "
                                                                         "(GET pages only)"))

    do_POST = do_PUT = do_PATCH = do_DELETE = _read_only  # noqa: N815 (http.server's names)

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        return is_loopback(host)

    def _send(self, response: Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        if response.filename is not None:
            self.send_header("Content-Disposition", f'attachment; filename="{response.filename}"')
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log is not None:
            self.server.log(format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    app: UiApp
    loopback_only: bool
    log: Callable[[str], None] | None


def make_server(app: UiApp, host: str = "127.0.0.1", port: int = 8000, *,
                log: Callable[[str], None] | None = None) -> _Server:
    """An HTTP server for `app` bound to host:port (port 0: any free port; `server.server_port` tells).
    A host other than loopback is allowed, with a warning on stderr: anyone who reaches it reads every
    prompt and reply of the runs."""
    if not is_loopback(host):
        print(f"drmas-graph ui: WARNING: serving on {host}, not only this machine: anyone who can reach "
              f"port {port} can read every prompt and reply of these runs (no authentication)", file=sys.stderr)
    server_class = type("_BoundServer", (_Server,), {"address_family": _family(host)})
    try:
        server = server_class((host, port), _Handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use (another drmas-graph ui?): choose another with "
                              "--port PORT, or --port 0 for any free port") from None
        raise ConfigError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    server.app = app
    server.loopback_only = is_loopback(host)
    server.log = log
    return server


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET

"""The web console: a Starlette application, Jinja2 templates, uPlot charts; served by uvicorn.

Pages: ``/`` the overview, ``/pending`` the pending timers, ``/dead-letters`` the dead letters;
``/healthz`` for probes. Every write is a POST of a form:

- read-only unless an action token is configured (``--action-token-file``, in the chart a Secret):
  without one every write is refused, saying so;
- a browser session unlocks writes by giving the token once (``/unlock``); the session cookie is
  signed (itsdangerous) and holds a digest of the token, never the token, so a rotated token
  locks every session again;
- every form carries the session's CSRF token (a random value kept in the signed session and
  compared in constant time); a POST from another origin (``Origin`` header) is refused too;
- responses forbid framing and inline scripts (Content-Security-Policy), and nothing secret is
  shown: no setting but the topics, never a password, the token or a file's path.

Each refusal is a page with one line saying why and what to do, and a 4xx status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from timerwheel.config import parse_duration_ms
from timerwheel.console.actions import ActionRefused, Actions, Outcome
from timerwheel.console.browse import (
    DeadLetter,
    PendingPage,
    browse_dead_letters,
    browse_pending,
    dead_letter_at,
    dead_letters,
    partitions_text,
    preview,
)
from timerwheel.console.overview import COUNTED, Sampler, age_text, rate_text
from timerwheel.console.source import Installation
from timerwheel.errors import TimerwheelError
from timerwheel.log import stage_logger

HERE = Path(__file__).parent
#: Pending timers per page, by default and at most.
PAGE = 50
PAGE_MAX = 500
#: The pending page's default range: from now, this far ahead.
DEFAULT_AHEAD = "1h"

_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # the outcome page's back link; nothing leaves the site
    "Cache-Control": "no-store",
}


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_time(text: str, now_ms: int, tz_offset_min: int = 0) -> int:
    """Epoch ms, ``now``, ``now+10m`` / ``now-1h``, or ISO 8601 (without a zone: the viewer's, whose
    offset from UTC ``Date.getTimezoneOffset()`` gives in minutes). ValueError names the text."""
    t = text.strip()
    if t.lstrip("-").isdigit():
        return int(t)
    if t.startswith("now"):
        rest = t[3:].strip()
        if not rest:
            return now_ms
        if rest[0] not in "+-":
            raise ValueError(f"expected now+DURATION or now-DURATION, got {text!r}")
        sign = -1 if rest[0] == "-" else 1
        return now_ms + sign * parse_duration_ms(rest[1:])
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        raise ValueError(f"expected epoch ms, now[+-DURATION] or an ISO 8601 time, got {text!r}") from None
    if when.tzinfo is None:
        return int(when.replace(tzinfo=UTC).timestamp() * 1000) + tz_offset_min * 60_000
    return int(when.timestamp() * 1000)


def _iso(ms: int | None) -> str:
    if ms is None:
        return ""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _text(value: bytes | None) -> str:
    return "(null)" if value is None else value.decode("utf-8", "backslashreplace")


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.filters.update(iso=_iso, age=age_text, rate=rate_text, text=_text, preview=preview,
                       bytes=lambda n: "-" if n is None else f"{n / 2**20:,.1f} MiB")
    return env


class Console:
    """The application's state: the installation, its sampler, the actions and the token."""

    def __init__(self, inst: Installation, action_token: str | None, sampler: Sampler) -> None:
        self.inst = inst
        self.sampler = sampler
        self.actions = Actions(inst)
        # Only a digest of the token is kept in sessions, keyed by this process's secret.
        self.session_key = secrets.token_bytes(32)
        self._token_digest = None if not action_token else hashlib.sha256(action_token.encode()).digest()
        self.templates = Jinja2Templates(env=_environment())
        self.log = stage_logger("console")

    @property
    def writable(self) -> bool:
        return self._token_digest is not None

    def token_matches(self, given: str) -> bool:
        return self._token_digest is not None and hmac.compare_digest(
            hashlib.sha256(given.encode()).digest(), self._token_digest)

    def unlock_mark(self) -> str:
        assert self._token_digest is not None
        return hmac.new(self.session_key, self._token_digest, hashlib.sha256).hexdigest()

    def unlocked(self, request: Request) -> bool:
        mark = request.session.get("unlocked")
        return self.writable and isinstance(mark, str) and hmac.compare_digest(mark, self.unlock_mark())

    # -- rendering ---------------------------------------------------------------------------------

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        csrf = request.session.get("csrf")
        if not isinstance(csrf, str):
            csrf = request.session["csrf"] = secrets.token_urlsafe(32)
        context.update(csrf=csrf, writable=self.writable, unlocked=self.unlocked(request),
                       timer_topic=self.inst.config.timer_topic, dlq_topic=self.inst.config.dlq_topic,
                       now_ms=self.inst.now_ms())
        return self.templates.TemplateResponse(request, name, context, status_code=status, headers=_HEADERS)

    def refusal(self, request: Request, refused: Refused) -> Response:
        self.log.info("console refused", path=request.url.path, status=refused.status, reason=refused.message)
        return self.render(request, "outcome.html", refused.status, ok=False, title="Refused",
                           detail=refused.message, back=request.headers.get("referer") or "/")

    # -- checks of a write -------------------------------------------------------------------------

    async def checked_form(self, request: Request, *, needs_unlock: bool = True) -> dict[str, str]:
        """The POSTed form, once the origin, the CSRF token and (``needs_unlock``) the action
        token say it may act; Refused otherwise."""
        origin = request.headers.get("origin")
        if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
            raise Refused(403, f"a form posted from another site ({origin}) is refused")
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        expected = request.session.get("csrf")
        if not isinstance(expected, str) or not hmac.compare_digest(form.get("csrf", ""), expected):
            raise Refused(403, "the form's CSRF token does not match this browser session (it expired or the "
                               "console restarted): reload the page and try again")
        if needs_unlock:
            if not self.writable:
                raise Refused(403, "the console is read-only: no action token is configured (console.actionToken in "
                                   "the chart, --action-token-file for timerwheel console)")
            if not self.unlocked(request):
                raise Refused(403, "write actions need the action token: unlock this session with it first (Unlock, "
                                   "top right)")
        return form


def create_app(inst: Installation, *, action_token: str | None = None, sample_every_s: float = 2.0,
               start_sampler: bool = True) -> Starlette:
    """The console over ``inst``; writes need ``action_token`` (None: read-only)."""
    sampler = Sampler(inst, sample_every_s)
    console = Console(inst, action_token, sampler)

    def page(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            t0 = time.perf_counter()
            try:
                response = await handler(request)
            except Refused as refused:
                response = console.refusal(request, refused)
            except (ActionRefused, ValueError) as exc:
                response = console.refusal(request, Refused(409 if isinstance(exc, ActionRefused) else 400, str(exc)))
            except (TimerwheelError, OSError) as exc:  # Kafka or the volume: say so, and what failed
                console.log.warning("page failed", path=request.url.path, error=repr(exc)[:300])
                response = console.refusal(request, Refused(503, f"the console cannot read the installation now: "
                                                                 f"{type(exc).__name__}: {str(exc)[:300]}"))
            response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - t0) * 1000:.1f}"
            return response
        return wrapped

    @page
    async def overview(request: Request) -> Response:
        snap = await run_in_threadpool(sampler.latest)
        charts = {
            "rates": {"t": [t for t, _ in snap.rate_history],
                      **{k: [round(r[k], 3) for _, r in snap.rate_history] for k in COUNTED}},
            "lateness": {"bounds": [b if b != float("inf") else None for b, _ in snap.lateness],
                         "counts": [n for _, n in snap.lateness]},
            "due_minutes": {"start_ms": snap.due_from_ms, "counts": snap.due_minutes},
            "due_hours": {"start_ms": snap.due_from_ms, "counts": snap.due_hours},
        }
        return console.render(request, "overview.html", snap=snap, counted=COUNTED, charts=json.dumps(charts),
                              age_ms=inst.now_ms() - snap.at_ms)

    @page
    async def pending(request: Request) -> Response:
        q = request.query_params
        now = inst.now_ms()
        tz = int(q.get("tz") or 0) if (q.get("tz") or "0").lstrip("-").isdigit() else 0
        from_text, to_text = q.get("from") or "now", q.get("to") or f"now+{DEFAULT_AHEAD}"
        from_ms, to_ms = parse_time(from_text, now, tz), parse_time(to_text, now, tz)
        if to_ms <= from_ms:
            raise Refused(400, f"the range is empty: to ({to_text}) is not after from ({from_text})")
        limit_text = q.get("limit") or str(PAGE)
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= PAGE_MAX:
            raise Refused(400, f"limit must be 1..{PAGE_MAX}, got {limit_text!r}")
        topic, message_id = (q.get("topic") or "").strip() or None, (q.get("id") or "").strip() or None

        def browse() -> PendingPage:
            with inst.shards() as shards:
                return browse_pending(shards, inst.commit_log, inst.config, from_ms, to_ms, topic=topic,
                                      message_id=message_id, limit=int(limit_text), after=q.get("after") or None,
                                      columns=inst.columns())

        found = await run_in_threadpool(browse)
        params = {k: v for k, v in {"from": from_text, "to": to_text, "topic": topic or "", "id": message_id or "",
                                    "limit": limit_text, "tz": q.get("tz") or ""}.items() if v}
        next_url = None if found.next_cursor is None else "/pending?" + urlencode({**params, "after": found.next_cursor})
        return console.render(request, "pending.html", page=found, from_text=from_text, to_text=to_text,
                              from_ms=from_ms, to_ms=to_ms, topic=topic or "", message_id=message_id or "",
                              limit=limit_text, next_url=next_url, first=not q.get("after"))

    @page
    async def dead_letter_page(request: Request) -> Response:
        q = request.query_params
        reason, source = (q.get("reason") or "").strip() or None, (q.get("source") or "").strip() or None
        found = await run_in_threadpool(lambda: browse_dead_letters(inst.commit_log, inst.config, reason=reason,
                                                                    source=source, before=q.get("before") or None))
        params = {k: v for k, v in {"reason": reason or "", "source": source or ""}.items() if v}
        next_url = None if found.next_cursor is None else "/dead-letters?" + urlencode(
            {**params, "before": partitions_text(found.next_cursor)})
        return console.render(request, "dead_letters.html", page=found, reason=reason or "", source=source or "",
                              next_url=next_url)

    def outcome(request: Request, done: Outcome) -> Response:
        console.log.info("console action", path=request.url.path, title=done.title, detail=done.detail)
        return console.render(request, "outcome.html", ok=True, title=done.title, detail=done.detail,
                              ticket=done.ticket, refused=done.refused, back=request.headers.get("referer") or "/")

    @page
    async def cancel(request: Request) -> Response:
        form = await console.checked_form(request)
        return outcome(request, await run_in_threadpool(console.actions.cancel, form.get("id", "")))

    @page
    async def deliver_now(request: Request) -> Response:
        form = await console.checked_form(request)
        return outcome(request, await run_in_threadpool(console.actions.deliver_now, form.get("id", "")))

    @page
    async def reschedule(request: Request) -> Response:
        form = await console.checked_form(request)
        when = form.get("deliver_at", "").strip()
        if not when:
            raise Refused(400, "no new delivery time given (e.g. now+10m, or a date and time)")
        tz = form.get("tz", "0")
        at = parse_time(when, inst.now_ms(), int(tz) if tz.lstrip("-").isdigit() else 0)
        return outcome(request, await run_in_threadpool(console.actions.reschedule, form.get("id", ""), at))

    @page
    async def redrive(request: Request) -> Response:
        form = await console.checked_form(request)
        letters: list[DeadLetter]
        if form.get("partition", "").isdigit() and form.get("offset", "").isdigit():
            one = await run_in_threadpool(dead_letter_at, inst.commit_log, inst.config, int(form["partition"]),
                                          int(form["offset"]))
            if one is None:
                raise Refused(404, f"no dead letter at partition {form['partition']} offset {form['offset']} of "
                                   f"{inst.config.dlq_topic!r} (gone by retention?)")
            letters = [one]
        else:
            reason, source = form.get("reason", "").strip() or None, form.get("source", "").strip() or None
            if not reason and not source:
                raise Refused(400, "a redrive by filter needs a reason or a source: redriving every dead letter at "
                                   "once is not offered")
            letters = await run_in_threadpool(lambda: dead_letters(inst.commit_log, inst.config, reason=reason,
                                                                   source=source, at_most=10_001))
        return outcome(request, await run_in_threadpool(console.actions.redrive, letters))

    @page
    async def unlock(request: Request) -> Response:
        if request.method == "GET":
            return console.render(request, "unlock.html")
        form = await console.checked_form(request, needs_unlock=False)
        if not console.writable:
            raise Refused(403, "the console is read-only: no action token is configured, so there is nothing to "
                               "unlock (console.actionToken in the chart, --action-token-file for timerwheel console)")
        if not console.token_matches(form.get("token", "")):
            raise Refused(403, "that is not the action token")
        request.session["unlocked"] = console.unlock_mark()
        return RedirectResponse(form.get("next") or "/", status_code=303)

    @page
    async def lock(request: Request) -> Response:
        await console.checked_form(request, needs_unlock=False)
        request.session.pop("unlocked", None)
        return RedirectResponse("/", status_code=303)

    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def not_found(request: Request, _exc: Exception) -> Response:
        return console.refusal(request, Refused(404, f"no page at {request.url.path}"))

    routes = [
        Route("/", overview),
        Route("/pending", pending),
        Route("/pending/cancel", cancel, methods=["POST"]),
        Route("/pending/deliver-now", deliver_now, methods=["POST"]),
        Route("/pending/reschedule", reschedule, methods=["POST"]),
        Route("/dead-letters", dead_letter_page),
        Route("/dead-letters/redrive", redrive, methods=["POST"]),
        Route("/unlock", unlock, methods=["GET", "POST"]),
        Route("/lock", lock, methods=["POST"]),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    def warm() -> None:
        try:
            console.actions.warm()
        except Exception as exc:  # noqa: BLE001 - the first write connects again, and reports
            console.log.warning("connecting the writers failed", error=repr(exc)[:200])

    def started() -> None:
        if start_sampler:
            sampler.start()
        if console.writable:
            threading.Thread(target=warm, name="tw-console-warm", daemon=True).start()

    def stopped() -> None:
        sampler.stop()

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        started()
        try:
            yield
        finally:
            stopped()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found},
                    middleware=[Middleware(SessionMiddleware, secret_key=console.session_key.hex(),
                                           session_cookie="tw_console", same_site="strict", max_age=8 * 3600)])
    app.state.console = console
    return app


__all__ = ["create_app", "parse_time"]

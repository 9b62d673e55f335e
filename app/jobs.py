"""Long work as a job: a thread with progress, an estimate of the time left, a Stop, an id in the URL.

Anything a page does that can take more than a couple of seconds (a calibration, a harvest, an SAE
training, a corpus index, an evaluation) runs as a `Job`: the page starts it, then `watch_job` draws
its progress bar, the time left and a Stop button, polling the job a few times a second in a
fragment. The work itself never touches Streamlit: it receives `job.progress`, which it passes to the
analysis as its `on_progress` callback (both the `(done, total)` and the `(stage, done, total)`
shapes the analyses use are accepted). `progress` raises `JobStopped` once Stop is pressed, and so
does every model call the job's thread makes after it (`probes.cancel`: the engine checks before each
forward, decoding steps included; the remote client before each request and streamed record), so the
analysis ends within one forward, not at the end of the item in progress (a whole generation); through
a model server the closed stream frees the model at its next token.

- **Reattach**: the job id sits in the URL (`?job=...`), so a reloaded tab finds the same job. Ids
  are signed with a per-process secret: a tampered id, or one from another app process, is refused.
- **Nobody watching**: every poll stamps `last_seen`; a job not seen for `grace_s` seconds (its tabs
  closed) is stopped, unless the user asked it to keep running.
- **Finished results** stay in the registry by key (the newest `max_finished`, a result read counts as
  new), so reopening the page with the same settings shows the result at once. Short work run on the
  page itself (`app.context.compute`) keeps its result here too (`JobRegistry.keep`): one store for
  every finished result of every page.
- **Estimates**: before the first progress report a job's time left comes from the measured cost per
  unit of earlier jobs of its kind (kept in the user cache directory), then from its own rate.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import streamlit as st

from probes import cancel
from probes.zoo import user_cache_dir
from thoughtscope.errors import BadInputError, ThoughtscopeError
from thoughtscope.imports import before_thread

log = logging.getLogger(__name__)

RUNNING, DONE, FAILED, STOPPED = "running", "done", "failed", "stopped"
STOP_WAIT_S = 1.0  # how long a Stop press waits for the job's thread before the page goes on polling
URL_PARAM = "job"


class JobStopped(ThoughtscopeError):
    """Raised inside a job's work at its next progress report once Stop was pressed (or nobody watched)."""


@dataclass
class Job:
    """One piece of long work. Fields are read by the page; only the job's thread writes them."""

    id: str
    key: str
    kind: str
    label: str
    page: str = ""
    keep_running: bool = False
    status: str = RUNNING
    stage: str = ""
    done: int = 0
    total: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    result: Any = None
    error: str | None = None
    stop_reason: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    prior_s_per_unit: float | None = None
    resumes: str = ""  # what a stopped run keeps, so that starting it again goes on (empty: it starts over)
    _stage_started: float = field(default_factory=time.monotonic)
    _stage_done0: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)

    # ---- called from the work's thread ----
    def progress(self, *args: Any) -> None:
        """`progress(done, total)` or `progress(stage, done, total)`; raises `JobStopped` after a Stop."""
        if len(args) == 3:
            stage, done, total = args
        elif len(args) == 2:
            stage, (done, total) = self.stage, args
        else:
            raise TypeError("progress takes (done, total) or (stage, done, total)")
        if stage != self.stage:
            self.stage, self._stage_started, self._stage_done0 = str(stage), time.monotonic(), int(done)
        self.done, self.total = int(done), int(total)
        self.check()

    def check(self) -> None:
        """Raise `JobStopped` if the job was asked to stop (work without progress reports calls this)."""
        if self._stop.is_set():
            raise JobStopped(self.stop_reason or "stopped")

    # ---- called from the page ----
    def stop(self, reason: str = "stopped by the user") -> None:
        if self.status == RUNNING and not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set() and self.status == RUNNING

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 0.0

    def eta_s(self) -> float | None:
        """Seconds left in the current stage: from this job's own rate once it has one, else the prior."""
        if self.status != RUNNING or not self.total:
            return None
        left = max(0, self.total - self.done)
        units = self.done - self._stage_done0
        if units > 0:
            return (time.monotonic() - self._stage_started) / units * left
        if self.prior_s_per_unit is not None:
            return self.prior_s_per_unit * left
        return None

    def describe(self) -> str:
        """One line: stage, counts, time so far and left."""
        parts = [self.stage] if self.stage else []
        if self.total:
            parts.append(f"{self.done}/{self.total}")
        parts.append(f"{_clock(self.elapsed_s)} so far")
        eta = self.eta_s()
        if self.status == RUNNING:
            parts.append(f"about {_clock(eta)} left" if eta is not None else "estimating the time left\u2026")
        return " \u00b7 ".join(parts)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def _reap_while_held(ref: "weakref.ReferenceType[JobRegistry]") -> None:
    """Once a second, stop the registry's unwatched jobs; return once the registry itself is gone."""
    while True:
        time.sleep(1.0)
        registry = ref()
        if registry is None:
            return
        registry.reap()
        del registry  # no strong reference kept across the sleep


class JobRegistry:
    """Every job of this app process: start, find by id or key, stop, reap the unwatched."""

    def __init__(self, grace_s: float = 30.0, max_finished: int = 96, costs_path: Path | None = None):
        self.grace_s = grace_s
        self.max_finished = max_finished
        self._secret = secrets.token_bytes(16)
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()
        self._costs_path = costs_path
        # the reaper holds the registry weakly: a registry nobody holds (a test's, a bench's) ends its thread
        self._reaper = threading.Thread(target=_reap_while_held, args=(weakref.ref(self),),
                                        name="thoughtscope-job-reaper", daemon=True)
        self._reaper.start()

    # ---- ids ----
    def _sign(self, raw: str) -> str:
        return hmac.new(self._secret, raw.encode(), hashlib.sha256).hexdigest()[:16]

    def _new_id(self) -> str:
        raw = secrets.token_hex(8)
        return f"{raw}.{self._sign(raw)}"

    # ---- starting and finding ----
    def start(self, key: str, work: Callable[[Job], Any], *, label: str, kind: str = "", page: str = "",
              keep_running: bool = False, resumes: str = "") -> Job:
        """Run `work(job)` in a thread, unless a job for `key` is running (then that one is returned).
        The finished result (work's return value) lands in `job.result`."""
        with self._lock:
            for job in self._jobs.values():
                if job.key == key and job.status == RUNNING:
                    return job
            job = Job(self._new_id(), key, kind or key, label, page=page, keep_running=keep_running,
                      prior_s_per_unit=self._prior(kind or key), resumes=resumes)
            self._jobs[job.id] = job
            self._trim()
        before_thread()  # a job may import pandas (RISE: sae_lens -> transformer_lens -> datasets): thoughtscope.imports
        job.thread = threading.Thread(target=self._run, args=(job, work), name=f"thoughtscope-job-{kind}",
                                      daemon=True)
        job.thread.start()
        return job

    def _run(self, job: Job, work: Callable[[Job], Any]) -> None:
        try:
            with cancel.checking(job.check):  # a Stop ends the work at its next model call, not its next item
                job.result = work(job)
            job.status = DONE
            self._learn(job)
        except JobStopped:
            job.status = STOPPED
        except ThoughtscopeError as err:
            job.error, job.status = str(err), FAILED
        except Exception as err:  # a bug, not a user's mistake: the page shows it, the app stays up
            job.error, job.status = f"{type(err).__name__}: {err}", FAILED
        finally:
            job.ended = time.monotonic()

    def get(self, job_id: str, page: str | None = None) -> Job:
        """The job with this id (from the URL): refused with a message when tampered, unknown or not this
        page's."""
        raw, _, sig = str(job_id).partition(".")
        # bytes: compare_digest refuses str with non-ASCII characters (a TypeError, for `?job=abc.é`)
        if not raw or not hmac.compare_digest(sig.encode("utf-8", "replace"), self._sign(raw).encode()):
            raise BadInputError(f"the job id {job_id!r} in the address is not one this app made (tampered with, "
                                "or from another app process); it was ignored")
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise BadInputError(f"the job {job_id} is no longer known (finished long ago, or the app restarted)")
        if page is not None and job.page and job.page != page:
            raise BadInputError(f"the job {job_id} belongs to the {job.page} page, not this one")
        return job

    def for_key(self, key: str) -> Job | None:
        """The newest job for `key` (running, or finished with its result)."""
        with self._lock:
            for job in reversed(self._jobs.values()):
                if job.key == key:
                    return job
        return None

    def finished(self, key: str) -> Any:
        """The result of the newest finished job for `key`, or None (a result read is kept longest)."""
        with self._lock:
            for job in reversed(self._jobs.values()):
                if job.key == key and job.status == DONE:
                    self._jobs.move_to_end(job.id)
                    return job.result
        return None

    def keep(self, key: str, result: Any, *, kind: str = "", label: str = "", page: str = "") -> Job:
        """Keep `result`, made outside a job (short work: `app.context.compute`), as the finished job for
        `key`: one store holds every finished result, whichever way it was made."""
        now = time.monotonic()
        job = Job(self._new_id(), key, kind or key, label, page=page, status=DONE, result=result, started=now,
                  ended=now)
        with self._lock:
            self._jobs[job.id] = job
            self._trim()
        return job

    def running(self) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if j.status == RUNNING]

    def seen(self, job: Job) -> None:
        job.last_seen = time.monotonic()

    def _trim(self) -> None:
        ended = [k for k, j in self._jobs.items() if j.status != RUNNING]
        while len(ended) > self.max_finished:
            self._jobs.pop(ended.pop(0), None)

    # ---- nobody watching ----
    def reap(self, now: float | None = None) -> list[Job]:
        """Stop the running jobs nobody has watched for `grace_s` (unless asked to keep running)."""
        now = time.monotonic() if now is None else now
        stopped = []
        for job in self.running():
            if not job.keep_running and now - job.last_seen > self.grace_s:
                job.stop(f"stopped: no open page watched it for {self.grace_s:.0f} s")
                # said in the terminal too: the user who closed the tab learns where the run went
                # (the id's unsigned part: the terminal names the job without handing out its URL)
                log.warning("thoughtscope: job %s (%s) %s", job.id.partition(".")[0], job.label, job.stop_reason)
                stopped.append(job)
        return stopped

    # ---- measured cost per unit, for the first estimate ----
    def _load_costs(self) -> dict[str, float]:
        if self._costs_path is None or not self._costs_path.is_file():
            return {}
        try:
            return {k: float(v) for k, v in json.loads(self._costs_path.read_text()).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _prior(self, kind: str) -> float | None:
        return self._load_costs().get(kind)

    def _learn(self, job: Job) -> None:
        if self._costs_path is None or not job.total:
            return
        costs = self._load_costs()
        costs[job.kind] = job.elapsed_s / job.total
        try:
            self._costs_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._costs_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(costs, sort_keys=True))
            os.replace(tmp, self._costs_path)
        except OSError:
            pass  # an estimate is a convenience; a read-only cache costs only the first estimate


# ----------------------------------------------------------------------------- the page side


@st.cache_resource(show_spinner=False)
def registry() -> JobRegistry:
    """The process-wide registry (one per Streamlit server, shared by its sessions). The grace period of
    an unwatched job is `$THOUGHTSCOPE_JOB_GRACE_S` seconds when set (a positive number), else 30 s."""
    return JobRegistry(grace_s=grace_from_env(), costs_path=user_cache_dir() / "job_costs.json")


GRACE_ENV = "THOUGHTSCOPE_JOB_GRACE_S"


def grace_from_env(default: float = 30.0) -> float:
    """`$THOUGHTSCOPE_JOB_GRACE_S` as seconds (> 0), or `default` when unset; a bad value is a clear error."""
    raw = os.environ.get(GRACE_ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise BadInputError(f"{GRACE_ENV}={raw!r}: give the grace period of an unwatched job as a positive "
                            "number of seconds (e.g. 30)")
    return value


def one_step(stage: str, work: Callable[[], Any]) -> Callable[[Job], Any]:
    """`work()` of one model call (a generation) as a job's work: `stage` at 0/1 before it and 1/1 after, so the
    bar shows what runs; a Stop pressed meanwhile ends the call at its next forward (probes.cancel).

        run_job(key, one_step("generate", lambda: generate_text(backend, prompt)), label=..., ...)
    """

    def job_work(job: Job) -> Any:
        job.progress(stage, 0, 1)
        result = work()
        job.progress(stage, 1, 1)
        return result

    return job_work


def url_job(page: str) -> Job | None:
    """The job named in the address (`?job=...`) when it is this page's; a bad id is shown and dropped."""
    job_id = st.query_params.get(URL_PARAM)
    if not job_id:
        return None
    try:
        return registry().get(job_id, page=page)
    except BadInputError as err:
        st.warning(str(err), icon=":material/link_off:")
        del st.query_params[URL_PARAM]
        return None


def run_job(key: str, work: Callable[[Job], Any], *, label: str, kind: str, page: str,
            start: bool, keep_running_option: bool = True, resumes: str = "") -> Any:
    """The one "button, compute, keep" block of a page: the finished result for `key` if there is one;
    else, when `start` (the page's button was pressed) or a job for `key` runs or is named in the URL,
    its progress with Stop; returns the result once done (None while it runs or after a Stop).
    `resumes`: what the work keeps as it goes (a store, a checkpoint), said after a Stop.
    Starting a job stops this page's other job of the same kind (made with settings since changed)."""
    reg = registry()
    done = reg.finished(key)
    if done is not None:
        return done
    job = reg.for_key(key)
    if job is None:
        from_url = url_job(page)
        job = from_url if from_url is not None and from_url.key == key else None
    if start and (job is None or job.status != RUNNING):
        keep = bool(st.session_state.get(f"job_keep_{kind}", False))
        for other in reg.running():
            if other.kind == kind and other.page == page and other.key != key:
                other.stop("stopped: the same work was started with other settings")
        job = reg.start(key, work, label=label, kind=kind, page=page, keep_running=keep, resumes=resumes)
    if job is None:
        return None
    if job.status == RUNNING:
        st.query_params[URL_PARAM] = job.id
        if keep_running_option:
            st.checkbox("Keep running when no page shows it", key=f"job_keep_{kind}",
                        help=f"otherwise a job stops {reg.grace_s:.0f} s after its last tab closed")
    return watch_job(job)


def stopped_message(job: Job) -> str:
    """What the page says after a Stop: how far the work got, and whether starting it again goes on from there
    (work that stores as it goes: a RISE harvest, RLKV's checkpoints) or starts over."""
    then = (f"Start it again to go on where it stopped: {job.resumes}." if job.resumes
            else "Start it again to go on from scratch.")
    return (f"{job.label}: {job.stop_reason or 'stopped'} after {_clock(job.elapsed_s)} "
            f"({job.done}/{job.total} {job.stage}). ".replace(" ()", "") + then)


def watch_job(job: Job) -> Any:
    """Draw `job`'s progress (polled in a fragment) with a Stop button; its result once done."""
    reg = registry()

    @st.fragment(run_every=0.5)
    def _progress() -> None:
        reg.seen(job)
        if job.status != RUNNING:
            st.rerun()  # the whole page draws the result (or the message) now
        with st.container(border=True, key=f"job-{job.id}"):
            st.progress(job.fraction(), text=f"**{job.label}** \u00b7 {job.describe()}")
            if job.stopping:
                st.caption("stopping at the next model call\u2026")
            elif st.button("Stop", key=f"stop-{job.id}", icon=":material/stop_circle:"):
                job.stop()
                if job.thread is not None:  # the work ends within one forward (probes.cancel): say so now, not
                    job.thread.join(STOP_WAIT_S)  # at the next poll
                if job.status != RUNNING:
                    st.rerun()

    if job.status == RUNNING:
        _progress()
        return None
    if st.query_params.get(URL_PARAM) == job.id:
        del st.query_params[URL_PARAM]
    if job.status == DONE:
        return job.result
    if job.status == STOPPED:
        st.info(stopped_message(job), icon=":material/stop_circle:")
    elif job.status == FAILED:
        st.error(f"{job.label} failed: {job.error}", icon=":material/error:")
    return None

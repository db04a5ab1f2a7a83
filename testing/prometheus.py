"""A real Prometheus for the tests and validation scripts: dashboards' PromQL is evaluated by
the program Grafana would ask, scraping real servers, not by an evaluator of our own.

``prometheus`` is Debian's package (``scripts/setup.sh`` installs it as root, never as a
service). :class:`Prometheus` runs it on a free loopback port with a temporary config and
storage, tied to this process (:func:`testing.children.popen_tied`), and talks to its HTTP
API with urllib. Waits are bounded polls of what Prometheus itself reports (readiness, the
scrapes it has made), never guessed sleeps.
"""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from testing.children import popen_tied
from testing.server_process import free_port

NO_PROMETHEUS_REASON = ("needs Prometheus (the `prometheus` binary): scripts/setup.sh installs Debian's package "
                        "with apt as root; this machine has neither apt access nor the binary")


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def require_prometheus() -> None:
    """Skip the calling test, saying why, where no Prometheus can be run."""
    if prometheus_binary() is None:
        import pytest

        pytest.skip(NO_PROMETHEUS_REASON)


class PrometheusError(RuntimeError):
    """Prometheus answered a query with an error (a PromQL syntax error, say)."""


class Prometheus:
    """``prometheus`` scraping ``targets`` (job name -> ``host:port`` or ``http://host:port/path``)
    every ``scrape_interval_s``. Use as a context manager."""

    def __init__(self, targets: Mapping[str, str], *, scrape_interval_s: float = 1.0) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise FileNotFoundError(NO_PROMETHEUS_REASON)
        self.binary = binary
        self.targets = dict(targets)
        self.scrape_interval_s = scrape_interval_s
        self.dir = Path(tempfile.mkdtemp(prefix="glm-prometheus-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "prometheus.log"

    def _config(self) -> str:
        """The YAML config (JSON is YAML): one job per target, scraped at ``scrape_interval_s``."""
        interval = f"{round(self.scrape_interval_s * 1000)}ms"
        jobs = []
        for job, target in self.targets.items():
            u = urllib.parse.urlsplit(target if "://" in target else "http://" + target)
            jobs.append({"job_name": job, "scrape_interval": interval, "scrape_timeout": interval,
                         "metrics_path": u.path or "/metrics", "scheme": u.scheme,
                         "static_configs": [{"targets": [u.netloc]}]})
        return json.dumps({"global": {"scrape_interval": interval, "evaluation_interval": interval},
                           "scrape_configs": jobs}, indent=1)

    def start(self, timeout_s: float = 60.0) -> Prometheus:
        """Start and return once ``/-/ready`` answers 200. A port taken since :func:`free_port`
        picked it makes Prometheus exit at once: then another port is picked (three tries)."""
        config = self.dir / "prometheus.yml"
        config.write_text(self._config())
        atexit.register(self.stop)
        for attempt in range(3):
            cmd = [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                   f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
                   "--log.level=warn"]
            with open(self.log_path, "ab") as log:
                self.proc = popen_tied(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                        if r.status == 200:
                            return self
                except OSError:
                    pass
                time.sleep(0.05)
            else:
                log = self.log()
                self.stop()
                raise RuntimeError(f"prometheus not ready within {timeout_s}s:\n{log}")
            log = self.log()
            if "address already in use" not in log or attempt == 2:
                self.stop()
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{log}")
            self.port = free_port()
        raise AssertionError("unreachable")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, SIGKILL after ``grace_s``; the temporary storage goes with it."""
        atexit.unregister(self.stop)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the HTTP API -------------------------------------------------------------------

    def _api(self, path: str, params: Mapping[str, Any]) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
            doc = json.loads(e.read() or b"{}")
            raise PrometheusError(f"{path} {dict(params)}: {doc.get('errorType')}: {doc.get('error')}") from None
        if doc.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params)}: {doc}")
        return doc["data"]

    def query(self, promql: str, time: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector: ``[{"metric": labels, "value": [t, "v"]}]`` (a scalar
        answer comes back as one sample with no labels)."""
        data = self._api("query", {"query": promql, "time": time})
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's matrix: ``[{"metric": labels, "values": [[t, "v"], ...]}]``."""
        return self._api("query_range", {"query": promql, "start": start, "end": end, "step": step})["result"]

    def value(self, promql: str, time: float | None = None) -> float | None:
        """The one number an instant query answers, or None for an empty vector."""
        result = self.query(promql, time)
        if len(result) > 1:
            raise PrometheusError(f"{promql!r} answered {len(result)} series, not one")
        return float(result[0]["value"][1]) if result else None

    # --- waiting on scrapes -------------------------------------------------------------

    def scrapes(self, job: str) -> int:
        """How many scrapes of ``job`` Prometheus has recorded (one ``up`` sample each)."""
        return int(self.value(f'sum(count_over_time(up{{job="{job}"}}[1d]))') or 0)

    def last_scrape(self, job: str) -> float | None:
        """When the newest successful scrape of ``job`` began (epoch seconds)."""
        up = f'up{{job="{job}"}}'  # timestamp() of a selector is its sample's time; of anything else, now
        return self.value(f"max(timestamp({up}) and {up} == 1)")

    def wait_scrapes(self, job: str, n: int, timeout_s: float = 60.0) -> None:
        """Return once ``job`` has been scraped at least ``n`` times."""
        self._wait(lambda: self.scrapes(job) >= n, f"{n} scrapes of {job}", timeout_s)

    def wait_scraped_after(self, job: str, t: float, timeout_s: float = 60.0) -> float:
        """Return, once it exists, the start of a successful scrape of ``job`` that began after
        ``t`` (epoch seconds): its samples were read after everything done before ``t``."""
        found: list[float] = []

        def done() -> bool:
            last = self.last_scrape(job)
            if last is not None and last > t:
                found.append(last)
            return bool(found)
        self._wait(done, f"a scrape of {job} after {t:.3f}", timeout_s)
        return found[0]

    def _wait(self, done: Any, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s}s; targets: {self._api('targets', {})}")
            time.sleep(self.scrape_interval_s / 10)

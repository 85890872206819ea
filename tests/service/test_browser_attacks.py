"""Attacks through a real browser (headless Chromium) on the controller service (issue 39):
cross-site auto-submitted forms and ``no-cors`` fetches against the REST API of an open server
and of a token server the user is logged in to (the attacker on another loopback port: the same
"site" for SameSite cookies), a page framing the dashboard, a DNS-rebound name, and /docs
rendering from the package under the Content-Security-Policy.

Mechanism: the controller service's job verbs (cancel, suspend) acting only for their user."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from test_dashboard_browser import CHROMEDRIVER, CHROMIUM, WAIT, browser, ticking_job, wait_for  # noqa: F401
from server_process import ServerProcess
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC

pytestmark = pytest.mark.timeout(300)

TOKEN = "browser-token-271828"


class AttackerSite:
    """Pages served from another loopback port (another origin, the same site)."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        handler = partial(_Quiet, directory=str(root))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def page(self, name: str, html: str) -> str:
        (self.root / name).write_text(html)
        return f"{self.url}/{name}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def attacker(tmp_path: Path) -> Iterator[AttackerSite]:
    site = AttackerSite(tmp_path / "attacker")
    yield site
    site.close()


def form_page(action: str) -> str:
    """The classic JSON CSRF: a text/plain form whose body looks like JSON, auto-submitted."""
    return (
        f'<form id="f" method="POST" action="{action}" enctype="text/plain">'
        '<input name=\'{"role": "main", "replicas": 1, "x": "\' value=\'"}\'></form>'
        "<script>document.getElementById('f').submit()</script>"
    )


def fetch_page(targets: list[str]) -> str:
    calls = ",".join(
        f'fetch("{t}", {{method: "POST", mode: "no-cors", credentials: "include", '
        f'headers: {{"Content-Type": "application/json"}}, body: "{{}}"}})'
        for t in targets
    )
    return f"<script>Promise.allSettled([{calls}]).then(() => {{ document.title = 'sent'; }})</script>"


def attack(driver: webdriver.Chrome, site: AttackerSite, server: ServerProcess, job_id: int) -> None:
    """Every cross-site trick against the job: forms for cancel and delete, no-cors fetches for
    suspend, cancel, scale and delete; each page loaded until its request has gone."""
    api = f"{server.url}/api/v1/jobs/{job_id}"
    for verb in ("cancel", "suspend", "scale"):
        driver.get(site.page(f"form-{verb}.html", form_page(f"{api}/{verb}")))
        wait_for(driver, lambda d: not d.current_url.startswith(site.url), f"the {verb} form to post")
    driver.get(site.page("fetch.html", fetch_page([f"{api}/suspend", f"{api}/cancel", f"{api}/scale"])))
    wait_for(driver, EC.title_is("sent"), "the no-cors fetches to be sent")
    time.sleep(1.5)  # a reconcile pass (0.2 s) would have acted on an accepted cancel by now


def untouched(server: ServerProcess, job_id: int) -> None:
    status = server.status(job_id)
    assert status["state"] == "running", status["events"][-5:]
    assert not any(e["reason"] in ("CancelRequested", "Cancelled", "Suspended") for e in status["events"]), status[
        "events"
    ][-5:]


def test_cross_site_forms_and_no_cors_fetches_change_nothing(
    tmp_path: Path, browser: webdriver.Chrome, attacker: AttackerSite
) -> None:
    """Against an open loopback server, and against a token server after the user logged in
    (the cookie is sent to other ports of the host): no job is cancelled or suspended; the
    dashboard's own Cancel (same origin, CSRF token) still works with the cookie."""
    (tmp_path / "open").mkdir()
    (tmp_path / "token").mkdir()
    open_server = ServerProcess(tmp_path / "open")
    try:
        job_id = open_server.submit(ticking_job("open-target"))
        open_server.wait_state(job_id, {"running"})
        attack(browser, attacker, open_server, job_id)
        untouched(open_server, job_id)
        httpx.post(f"{open_server.url}/api/v1/jobs/{job_id}/cancel", json={}, timeout=10)
        open_server.wait_state(job_id, {"cancelled"})  # its instance does not outlive the test
    finally:
        open_server.stop()
    token_server = ServerProcess(tmp_path / "token", token=TOKEN)
    try:
        job_id = token_server.submit(ticking_job("token-target"))
        token_server.wait_state(job_id, {"running"})
        browser.get(f"{token_server.url}/login?token={TOKEN}")
        wait_for(browser, EC.presence_of_element_located((By.ID, f"job-{job_id}")), "the job list after login")
        attack(browser, attacker, token_server, job_id)
        untouched(token_server, job_id)
        browser.get(f"{token_server.url}/jobs/{job_id}")  # the user's own page acts, as before
        wait_for(browser, EC.element_to_be_clickable((By.ID, "cancel")), "the Cancel button")
        # the live refresh may replace the button between a find and a click: click inside the wait
        wait_for(browser, _clicked("cancel"), "a click on the Cancel button")
        wait_for(browser, EC.alert_is_present(), "the cancel confirmation")
        browser.switch_to.alert.accept()
        token_server.wait_state(job_id, {"cancelled"})
    finally:
        token_server.stop()


def test_another_origin_cannot_frame_the_dashboard(
    tmp_path: Path, browser: webdriver.Chrome, attacker: AttackerSite
) -> None:
    server = ServerProcess(tmp_path)
    try:
        job_id = server.submit(ticking_job("framed", ticks=40))
        page = attacker.page(
            "frame.html", f'<iframe id="victim" src="{server.url}/jobs/{job_id}" width=900 height=700></iframe>'
        )
        browser.get(page)
        frame = wait_for(browser, EC.presence_of_element_located((By.ID, "victim")), "the iframe")
        time.sleep(2)  # the frame's navigation is refused, not slow
        browser.switch_to.frame(frame)
        try:
            assert not browser.find_elements(By.ID, "cancel") and not browser.find_elements(By.ID, "job-state")
        finally:
            browser.switch_to.default_content()
        browser.get(f"{server.url}/docs")  # the API reference: swagger-ui from the package, under the CSP
        title = wait_for(
            browser, EC.presence_of_element_located((By.CSS_SELECTOR, ".swagger-ui .info .title")), "/docs to render"
        )
        assert "Trainmaster controller" in title.text
        wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".opblock")) >= 8, "the operations listed")
        httpx.post(f"{server.url}/api/v1/jobs/{job_id}/cancel", json={}, timeout=10)
    finally:
        server.stop()


def test_a_dns_rebound_name_gets_no_page(tmp_path: Path) -> None:
    """The browser resolves the attacker's name to 127.0.0.1 (as after a DNS rebinding): the page
    it loads under that name from the server's port carries neither the jobs nor the CSRF token."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--host-resolver-rules=MAP rebind.attacker.example 127.0.0.1")
    server = ServerProcess(tmp_path)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT)
    try:
        job_id = server.submit(ticking_job("rebound", ticks=40))
        driver.get(f"http://rebind.attacker.example:{server.port}/")
        source = driver.page_source
        assert "rebound" not in source and "csrf-token" not in source and "rebinding" in source
        driver.get(f"{server.url}/")  # the server's own name still serves the page
        wait_for(driver, EC.presence_of_element_located((By.ID, f"job-{job_id}")), "the job list by address")
        httpx.post(f"{server.url}/api/v1/jobs/{job_id}/cancel", json={}, timeout=10)
    finally:
        driver.quit()
        server.stop()


def _clicked(element_id: str) -> Callable[[webdriver.Chrome], bool]:
    """A wait condition that clicks the element, found afresh at each look (False while the
    page replaces it)."""

    def click(driver: webdriver.Chrome) -> bool:
        try:
            driver.find_element(By.ID, element_id).click()
        except StaleElementReferenceException:
            return False
        return True

    return click

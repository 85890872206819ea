"""The web dashboard in a real headless Chromium (Selenium + Debian's chromium-driver).

Mechanism: the controller service's status you can query at any time (controller.md, "States and
counts are stored so that a user can query them at any time"), shown live in a browser: job list,
a job's instances, log tail, reported metrics, cancel, and validation errors next to their field.
Set ``TM_DASHBOARD_SCREENSHOTS=DIR`` to save each page's screenshot (``make screenshots``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.timeout(240)

CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
if not (CHROMEDRIVER and CHROMIUM):
    pytest.skip(
        "Chromium and chromedriver are not installed (Debian: apt-get install chromium chromium-driver; "
        "`make test` installs them)",
        allow_module_level=True,
    )

from orphans import orphan_a_run  # noqa: E402
from server_process import ServerProcess as Server  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SHOTS = os.environ.get("TM_DASHBOARD_SCREENSHOTS")
WAIT = 30  # seconds any page condition may take on a loaded 2-core machine


def _click(driver: webdriver.Chrome, element_id: str) -> bool:
    """Click the element now carrying ``element_id``; False (try again) if it was just replaced."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        driver.find_element(By.ID, element_id).click()
        return True
    except (StaleElementReferenceException, NoSuchElementException):
        return False


def ticking_job(name: str, ticks: int = 400) -> dict:
    """A job whose instance prints a line and reports a metric point every 0.25 s."""
    code = (
        "import time, trainmaster\n"
        f"for s in range(1, {ticks}):\n"
        "    print(f'tick {s} <b>not bold</b>', flush=True)\n"
        f"    trainmaster.report(step=s, total={ticks}, loss=1.0 / s)\n"
        "    time.sleep(0.25)\n"
    )
    return {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "framework": "command",
            "roles": [{"name": "main", "replicas": 1, "command": [sys.executable, "-c", code]}],
        },
    }


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()


def shot(driver: webdriver.Chrome, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1400, min(max(height + 40, 600), 2400))  # the whole page in one picture
        driver.save_screenshot(str(Path(SHOTS) / f"{name}.png"))
        driver.set_window_size(1400, 1000)


def wait_for(driver: webdriver.Chrome, condition, what: str):  # type: ignore[no-untyped-def]
    from selenium.common.exceptions import StaleElementReferenceException

    # parts of a page are re-rendered on every store change: an element found a moment ago may be
    # replaced while the condition looks at it; look again at the next poll
    return WebDriverWait(driver, WAIT, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)).until(
        condition, message=f"waited {WAIT}s for {what}"
    )


def test_job_list_job_page_live_log_metrics_and_cancel(server: Server, browser: webdriver.Chrome) -> None:
    """Job list, a running job's page, a log line appearing live, a reported metric point
    appearing on the chart, and cancel from the page changing the job's state."""
    job_id = server.submit(ticking_job("ticker"))
    browser.get(server.url + "/")
    # read the row inside the wait: the live refresh may replace it between a find and a read
    wait_for(
        browser,
        lambda d: "ticker" in (text := d.find_element(By.ID, f"job-{job_id}").text) and "command" in text,
        "the job's row",
    )
    wait_for(
        browser,
        lambda d: d.find_element(By.ID, f"job-{job_id}").get_attribute("data-state") == "running",
        "the list to show the job running (live refresh)",
    )
    shot(browser, "jobs")

    browser.find_element(By.LINK_TEXT, "ticker").click()
    wait_for(browser, EC.text_to_be_present_in_element((By.ID, "job-state"), "running"), "the job page")
    log = browser.find_element(By.ID, "log")
    wait_for(browser, lambda d: "tick 2 " in log.text, "the first log lines")
    seen = max(int(line.split()[1]) for line in log.text.splitlines() if line.startswith("tick "))
    wait_for(browser, lambda d: f"tick {seen + 4} " in log.text, "a log line printed after the page loaded")
    assert "<b>not bold</b>" in log.text  # log content is shown as text, never as markup
    assert not browser.find_elements(By.CSS_SELECTOR, "#log b")

    chart = browser.find_element(By.ID, "metrics-chart")
    wait_for(browser, lambda d: int(chart.get_attribute("data-points") or 0) > 0, "the first metric points")
    before = int(chart.get_attribute("data-points"))
    wait_for(browser, lambda d: int(chart.get_attribute("data-points")) > before, "a new metric point on the chart")
    shot(browser, "job")

    browser.find_element(By.ID, "cancel").click()
    wait_for(browser, EC.alert_is_present(), "the cancel confirmation")
    browser.switch_to.alert.accept()
    wait_for(
        browser,
        EC.text_to_be_present_in_element((By.ID, "job-state"), "cancelled"),
        "the job's state to change to cancelled",
    )
    status = httpx.get(f"{server.url}/api/v1/jobs/{job_id}", timeout=10).json()
    assert status["state"] == "cancelled"


def test_submit_shows_each_error_next_to_its_field(server: Server, browser: webdriver.Chrome) -> None:
    """A pasted file with mistakes: every error is shown beside the line of the field it names."""
    bad = yaml.safe_dump(
        {
            "apiVersion": "trainmaster/v1",
            "kind": "Job",
            "metadata": {"name": "broken"},
            "spec": {
                "framework": "command",
                "roles": [
                    {"name": "main", "replicas": 0, "command": ["true"]},
                    {"name": "side", "replicas": 1, "command": ["true"], "dependsOn": [{"role": "nowhere"}]},
                ],
            },
        },
        sort_keys=False,
    )
    browser.get(server.url + "/submit")
    box = browser.find_element(By.ID, "document")
    box.send_keys(bad)
    browser.find_element(By.ID, "validate").click()
    flagged = wait_for(
        browser,
        EC.presence_of_all_elements_located((By.CSS_SELECTOR, ".annotated li.has-problem")),
        "the annotated validation result",
    )
    by_path = {}
    for line in flagged:
        for problem in line.find_elements(By.CSS_SELECTOR, ".problem"):
            by_path[problem.get_attribute("data-path")] = line.text
    assert "replicas: 0" in by_path["spec.roles[0].replicas"]
    assert "role: nowhere" in by_path["spec.roles[1].dependsOn[0].role"]
    shot(browser, "submit-errors")

    box.clear()
    box.send_keys(yaml.safe_dump(ticking_job("fromform", ticks=3), sort_keys=False))
    browser.find_element(By.ID, "submit").click()
    wait_for(browser, EC.url_contains("/jobs/"), "the new job's page after submitting")
    wait_for(browser, EC.text_to_be_present_in_element((By.TAG_NAME, "h1"), "fromform"), "the submitted job's page")


def test_resume_an_orphaned_job_from_its_page(tmp_path: Path, browser: webdriver.Chrome) -> None:
    """A job whose `trainmaster run` was killed -9 shows that nobody runs it and a Resume action;
    resuming from the page makes the service finish it, each instance having run once."""
    marks, env = orphan_a_run(tmp_path, "orphan-ui", seconds=15)
    server = Server(tmp_path, db=env["TRAINMASTER_DB"], home=Path(env["TRAINMASTER_HOME"]))
    try:
        job_id = httpx.get(f"{server.url}/api/v1/jobs/orphan-ui", timeout=10).json()["id"]
        browser.get(f"{server.url}/jobs/{job_id}")
        wait_for(browser, EC.element_to_be_clickable((By.ID, "resume")), "the Resume action")
        # read inside a wait: the summary is re-rendered on every store change, and an element
        # found just before a re-render is stale when its text is read
        wait_for(
            browser,
            lambda d: "nobody runs this job" in d.find_element(By.CLASS_NAME, "actions").text,
            "the page to say that nobody runs the job",
        )
        shot(browser, "job-orphaned")
        # the summary is re-rendered on every store change: click the button as it is now
        wait_for(browser, lambda d: _click(d, "resume"), "a click on the current Resume button")
        wait_for(browser, EC.alert_is_present(), "the resume confirmation")
        browser.switch_to.alert.accept()
        wait_for(browser, lambda d: not d.find_elements(By.ID, "resume"), "the Resume action to go once resumed")
        WebDriverWait(browser, 90, poll_frequency=0.5).until(
            EC.text_to_be_present_in_element((By.ID, "job-state"), "succeeded"),
            message="waited 90s for the resumed job to succeed",
        )
        assert len(list(marks.iterdir())) == 2  # neither instance ran a second time
    finally:
        server.stop()


PUBLISHER = """
import time, trainmaster
nodes = [{"id": f"op{i}", "device": i % 3, "critical": i % 4 == 0} for i in range(12)]
edges = [{"src": f"op{i}", "dst": f"op{i + 1}", "critical": i % 4 == 0} for i in range(11)]
trainmaster.publish("partition.plan", {"method": "trainmaster", "devices": 3, "nodes": nodes, "edges": edges})
for r in range(60):
    trainmaster.publish("flsched.round", {"round": r, "assignment": {"digits": [r % 8, (r + 3) % 8], "wine": [(r + 5) % 8]},
                                          "accuracy": {"digits": min(0.95, 0.3 + r / 30), "wine": min(0.9, 0.2 + r / 40)}})
    trainmaster.publish("aggregation.counters", {"time": time.time(), "node": "parameter node", "verified": 10 * r,
                                                 "overflow_fallbacks": r // 7, "slots_in_use": 4 + r % 3})
    trainmaster.publish("gateway.task", {"task": f"t{r // 10}", "legs": [
        {"data_id": "m_a", "party": "a", "rule": "summary_stats", "outcome": "result"},
        {"data_id": "m_b", "party": "b", "rule": "summary_stats", "outcome": "result" if r % 10 > 2 else "running"}]})
    time.sleep(0.5)
"""


def test_capability_views_draw_what_roles_publish(server: Server, browser: webdriver.Chrome) -> None:
    """A job's page draws what its roles publish: the federated schedule grid, aggregation counter
    charts, the partition graph and the gateway's legs, and keeps drawing new rounds."""
    job = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "capabilities"},
        "spec": {
            "framework": "command",
            "roles": [{"name": "main", "replicas": 1, "command": [sys.executable, "-c", PUBLISHER]}],
        },
    }
    job_id = server.submit(job)
    browser.get(f"{server.url}/jobs/{job_id}")
    # the views are redrawn as rounds are published (every 0.5 s): each read is inside a wait,
    # where an element replaced between its find and its read is tried again
    first = wait_for(
        browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#flsched-grid rect.cell")), "the federated schedule"
    )
    wait_for(
        browser,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#flsched-grid rect.cell")) > first,
        "new rounds drawn as the job publishes them",
    )
    wait_for(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, "#view-aggregation-counters div.counter"),
        "the aggregation counters",
    )
    wait_for(
        browser,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "svg.partition-graph circle.op")) == 12,
        "the partition graph's 12 operators",
    )
    wait_for(
        browser,
        lambda d: "summary_stats" in (legs := d.find_element(By.ID, "view-gateway-task").text) and "result" in legs,
        "the gateway task's legs",
    )
    shot(browser, "capabilities")
    httpx.post(f"{server.url}/api/v1/jobs/{job_id}/cancel", json={}, timeout=10)


def test_actions_need_the_csrf_token(server: Server) -> None:
    """A cross-site form cannot cancel a job: dashboard actions need the page's CSRF token."""
    job_id = server.submit(ticking_job("guarded", ticks=20))
    assert httpx.post(f"{server.url}/ui/jobs/{job_id}/cancel", timeout=10).status_code == 403
    assert (
        httpx.post(f"{server.url}/ui/jobs/{job_id}/cancel", headers={"X-CSRF-Token": "forged"}, timeout=10).status_code
        == 403
    )
    page = httpx.get(f"{server.url}/jobs/{job_id}", timeout=10).text
    token = page.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]
    assert (
        httpx.post(f"{server.url}/ui/jobs/{job_id}/cancel", headers={"X-CSRF-Token": token}, timeout=10).status_code
        == 204
    )


def test_token_guards_api_and_pages(tmp_path: Path) -> None:
    """With a token (required beyond loopback), nothing but /login and /healthz answers without it."""
    srv = Server(tmp_path, token="s3cret-token")
    try:
        assert httpx.get(srv.url + "/", timeout=10).status_code == 401
        assert httpx.get(srv.url + "/api/v1/jobs", timeout=10).status_code == 401
        assert (
            httpx.get(srv.url + "/api/v1/jobs", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code
            == 401
        )
        assert (
            httpx.get(
                srv.url + "/api/v1/jobs", headers={"Authorization": "Bearer s3cret-token"}, timeout=10
            ).status_code
            == 200
        )
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            assert client.get("/login", params={"token": "nope"}).status_code == 401
            assert client.get("/login", params={"token": "s3cret-token"}).status_code == 303
            assert client.get("/").status_code == 200  # the cookie from /login
    finally:
        srv.stop()


def test_big_store_and_big_log_stay_bounded(server: Server, tmp_path: Path) -> None:
    """1,000 jobs in the store: the list sends one page of 100. A 100 MB log: the page gets its
    last 64 KB and the follow stream pages from an offset; the whole file is never sent."""
    from trainmaster.store.db import make_engine, session_factory
    from trainmaster.store.models import JobRow

    sessions = session_factory(make_engine(server.env["TRAINMASTER_DB"]))
    spec = ticking_job("filler")
    with sessions() as session:
        session.add_all(JobRow(uid=f"u{n:04d}", name=f"filler-{n}", spec=spec, state="succeeded") for n in range(1000))
        session.commit()
    page = httpx.get(server.url + "/", timeout=30).text
    assert page.count('<tr id="job-') == 100 and "1000 job(s)" in page and "page 1 of 10" in page
    filtered = httpx.get(server.url + "/ui/jobs/table", params={"name": "filler-99"}, timeout=30).text
    assert filtered.count('<tr id="job-') == 11  # filler-99, filler-990..999

    job_id = server.submit(ticking_job("bigsay", ticks=2))
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        status = httpx.get(f"{server.url}/api/v1/jobs/{job_id}", timeout=10).json()
        if status["state"] == "succeeded":
            break
        time.sleep(0.2)
    log_path = Path(status["instances"][0]["logPath"])
    with open(log_path, "ab") as log:
        line = b"x" * 1023 + b"\n"
        for _ in range(100 * 1024):
            log.write(line)
    tail = httpx.get(f"{server.url}/ui/jobs/{job_id}/log", params={"instance": "main-0"}, timeout=10).json()
    assert tail["size"] > 100 * 1024 * 1024 and tail["truncated"]
    assert len(tail["text"]) == 64 * 1024 and tail["offset"] == tail["size"]
    part = httpx.get(
        f"{server.url}/ui/jobs/{job_id}/log", params={"instance": "main-0", "offset": 0}, timeout=10
    ).json()
    assert len(part["text"]) == 64 * 1024 and part["offset"] == 64 * 1024

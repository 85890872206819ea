// Trainmaster dashboard: live refresh from the store's change stream, log tail, metric curves.
"use strict";

const csrf = document.querySelector('meta[name="csrf-token"]').content;
document.body.addEventListener("htmx:configRequest", (e) => { e.detail.headers["X-CSRF-Token"] = csrf; });

// One stream per tab: the server sends "change" when anything a page shows moved.
(function liveChanges() {
  const live = document.getElementById("live");
  const source = new EventSource("/ui/stream");
  source.addEventListener("open", () => live.classList.remove("off"));
  source.addEventListener("error", () => live.classList.add("off"));  // EventSource reconnects by itself
  source.addEventListener("change", () => htmx.trigger(document.body, "tm-change"));
})();

// ---- metric curves -------------------------------------------------------------------------
(function metrics() {
  const canvas = document.getElementById("metrics-chart");
  if (!canvas) return;
  const job = canvas.dataset.job;
  let last = 0, chart = null, busy = false;
  const series = new Map();
  const palette = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"];

  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      const response = await fetch(`/ui/jobs/${job}/metrics?after=${last}`);
      if (!response.ok) return;
      const data = await response.json();
      last = data.last;
      for (const p of data.points) {
        if (!series.has(p.series)) {
          const color = palette[series.size % palette.length];
          series.set(p.series, {label: p.series, data: [], borderColor: color, backgroundColor: color,
                                yAxisID: p.metric.includes("acc") ? "y1" : "y", pointRadius: 2});
        }
        series.get(p.series).data.push({x: p.x, y: p.y});
      }
      if (!series.size) return;
      document.getElementById("metrics-empty").hidden = true;
      canvas.dataset.points = [...series.values()].reduce((n, s) => n + s.data.length, 0);
      if (!chart) {
        chart = new Chart(canvas, {type: "line", data: {datasets: [...series.values()]},
          options: {animation: false, parsing: false, responsive: true, maintainAspectRatio: false,
            scales: {x: {type: "linear", title: {display: true, text: "step / epoch"}},
                     y: {position: "left"}, y1: {position: "right", grid: {drawOnChartArea: false}}}}});
      } else {
        chart.data.datasets = [...series.values()];
        chart.update("none");
      }
    } finally { busy = false; }
  }
  refresh();
  document.body.addEventListener("tm-change", refresh);
})();

// ---- log tail ------------------------------------------------------------------------------
(function logs() {
  const select = document.getElementById("log-instance");
  if (!select) return;
  const job = select.dataset.job, pre = document.getElementById("log");
  const follow = document.getElementById("log-follow"), download = document.getElementById("log-download");
  const KEEP = 256 * 1024;  // characters kept on the page; the download has everything
  let stream = null;

  function append(text) {
    pre.textContent = (pre.textContent + text).slice(-KEEP);
    pre.scrollTop = pre.scrollHeight;
  }
  async function open() {
    if (stream) { stream.close(); stream = null; }
    const label = select.value;
    if (!label) return;
    const dash = label.lastIndexOf("-");
    download.href = `/api/v1/jobs/${job}/logs?role=${encodeURIComponent(label.slice(0, dash))}&index=${label.slice(dash + 1)}`;
    const response = await fetch(`/ui/jobs/${job}/log?instance=${encodeURIComponent(label)}`);
    if (!response.ok) return;
    const chunk = await response.json();
    pre.textContent = chunk.truncated ? "[... earlier lines: use download]\n" : "";
    append(chunk.text);
    if (follow.checked) {
      stream = new EventSource(`/ui/jobs/${job}/log/stream?instance=${encodeURIComponent(label)}&offset=${chunk.offset}`);
      stream.onmessage = (e) => append(JSON.parse(e.data).text);
    }
  }
  select.addEventListener("change", open);
  follow.addEventListener("change", open);
  open();
})();

// ---- submit: an uploaded file goes into the text box ----------------------------------------
(function upload() {
  const input = document.getElementById("upload");
  if (!input) return;
  input.addEventListener("change", async () => {
    if (input.files.length) document.getElementById("document").value = await input.files[0].text();
  });
})();

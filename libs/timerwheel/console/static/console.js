// timerwheel console: times in the viewer's time zone, and the overview's charts (uPlot).
"use strict";

(function () {
  const zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
  const pad = (n, w) => String(n).padStart(w || 2, "0");
  function local(ms) {
    const d = new Date(ms);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
  }

  function localTimes() {
    const z = document.getElementById("zone");
    if (z) z.textContent = zone;
    for (const el of document.querySelectorAll("time.ts[data-ms]")) {
      el.textContent = local(Number(el.dataset.ms));
      el.title = el.getAttribute("datetime") + " (UTC)";
    }
    // Times typed without a zone are the viewer's: the server gets the offset.
    for (const el of document.querySelectorAll("input.tz")) el.value = String(new Date().getTimezoneOffset());
  }

  function width(el) { return Math.max(320, el.clientWidth || 460); }

  function lines(el, data) {
    const t = data.t || [];
    const names = ["scheduled", "delivered", "cancelled", "dead_lettered"];
    const colors = ["#1565c0", "#2e7d32", "#8e24aa", "#c62828"];
    if (!t.length) { el.textContent = "no rates yet: two samples are needed"; return; }
    new uPlot({
      width: width(el), height: 220,
      series: [{}, ...names.map((n, i) => ({ label: n.replace("_", "-"), stroke: colors[i], width: 2 }))],
      axes: [{}, { label: "per second" }],
    }, [t, ...names.map((n) => data[n])], el);
  }

  function bars(el, xs, ys, xLabel, fmt) {
    if (!ys.some((v) => v > 0)) { el.textContent = "none"; return; }
    new uPlot({
      width: width(el), height: 220,
      scales: { x: { time: false } },
      series: [{ label: xLabel, value: (u, v) => fmt(v) },
        { label: "messages", fill: "#90caf9", stroke: "#1565c0", paths: uPlot.paths.bars({ size: [0.8, 40] }) }],
      axes: [{ values: (u, vals) => vals.map(fmt) }, {}],
    }, [xs, ys], el);
  }

  function charts() {
    const src = document.getElementById("chart-data");
    if (!src) return;
    if (typeof uPlot === "undefined") {  // the vendored library is fetched at build time
      for (const el of document.querySelectorAll(".chart")) {
        el.textContent = "no charts: uPlot is not installed (scripts/assets.sh fetch)";
      }
      return;
    }
    const data = JSON.parse(src.textContent);
    const rates = document.getElementById("chart-rates");
    if (rates) lines(rates, data.rates);
    const lat = document.getElementById("chart-lateness");
    if (lat) {
      const bounds = data.lateness.bounds;
      bars(lat, bounds.map((_, i) => i), data.lateness.counts, "≤ ms",
        (i) => (i == null || bounds[i] === undefined) ? "" : (bounds[i] === null ? "+Inf" : "≤" + bounds[i]));
    }
    const dm = document.getElementById("chart-due-minutes");
    if (dm) {
      const s = data.due_minutes.start_ms;
      bars(dm, data.due_minutes.counts.map((_, i) => i), data.due_minutes.counts, "minute",
        (i) => i == null ? "" : local(s + i * 60000).slice(11, 16));
    }
    const dh = document.getElementById("chart-due-hours");
    if (dh) {
      const s = data.due_hours.start_ms;
      bars(dh, data.due_hours.counts.map((_, i) => i), data.due_hours.counts, "hour",
        (i) => i == null ? "" : local(s + i * 3600000).slice(5, 13) + "h");
    }
  }

  document.addEventListener("DOMContentLoaded", () => { localTimes(); charts(); });
})();

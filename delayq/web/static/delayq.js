// delayq dashboard: live panels by short polling, sparkline charts, confirmations. No library.
"use strict";

(function () {
  const refresh = Number(document.body.dataset.refresh) || 2000;

  function sparkline(svg, points) {
    // Draw [t, value] pairs as a polyline in a 120x28 box; the last value as text.
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const ns = "http://www.w3.org/2000/svg";
    if (!points || points.length === 0) return;
    const ts = points.map((p) => p[0]), vs = points.map((p) => Number(p[1]) || 0);
    const t0 = Math.min(...ts), t1 = Math.max(...ts), top = Math.max(...vs, 1e-9);
    const xy = points.map((p, i) => {
      const x = t1 > t0 ? ((ts[i] - t0) / (t1 - t0)) * 88 : 88;
      const y = 26 - (vs[i] / top) * 24;
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", xy.join(" "));
    svg.appendChild(line);
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", "92");
    label.setAttribute("y", "18");
    const last = vs[vs.length - 1];
    label.textContent = last >= 100 ? String(Math.round(last)) : String(Math.round(last * 10) / 10);
    svg.appendChild(label);
  }

  function fill(container, data) {
    // Each [data-field] element shows data[field] (as text: never HTML); [data-flag] shows or hides.
    container.querySelectorAll("[data-field]").forEach((el) => {
      const name = el.dataset.field;
      if (name in data) el.textContent = data[name] === null ? "-" : String(data[name]);
    });
    container.querySelectorAll("[data-flag]").forEach((el) => {
      el.hidden = !data[el.dataset.flag];
    });
    if (data.series) {
      container.querySelectorAll("svg[data-chart]").forEach((svg) => sparkline(svg, data.series[svg.dataset.chart]));
    }
  }

  function apply(panel, data) {
    if (data.queues) {
      data.queues.forEach((q) => {
        const row = panel.querySelector('tr[data-queue="' + CSS.escape(q.queue) + '"]');
        if (row) fill(row, q);
      });
      const now = document.querySelector("[data-now]");
      if (now && data.now) now.textContent = data.now.replace(/\.\d+/, "");
    } else if (data.topics) {
      data.topics.forEach((t) => {
        const row = panel.querySelector('tr[data-topic="' + CSS.escape(t.topic) + '"]');
        if (row) fill(row, t);
      });
    } else {
      fill(panel, data);
    }
  }

  function poll(panel) {
    let timer = null;
    const tick = () => {
      if (document.hidden) { timer = setTimeout(tick, refresh); return; }
      fetch(panel.dataset.poll, { credentials: "same-origin", headers: { accept: "application/json" } })
        .then((r) => (r.ok ? r.json() : null))
        .then((data) => { if (data) { apply(panel, data); panel.dataset.polled = String(Date.now()); } })
        .catch(() => {})
        .finally(() => { timer = setTimeout(tick, refresh); });
    };
    tick();
    return () => clearTimeout(timer);
  }

  document.querySelectorAll("[data-poll]").forEach(poll);

  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  });
})();

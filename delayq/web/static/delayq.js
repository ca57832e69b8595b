// delayq dashboard: live panels by short polling, sparkline charts, confirmations. No library.
"use strict";

(function () {
  const refresh = Number(document.body.dataset.refresh) || 2000;

  function sparkline(svg, series) {
    // Draw each series of [t, value] pairs as a polyline in a 120x28 box, on one scale; the last value
    // of the last series as text.
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const ns = "http://www.w3.org/2000/svg";
    const all = series.flat();
    if (all.length === 0) return;
    const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
    const top = Math.max(...all.map((p) => Number(p[1]) || 0), 1e-9);
    series.forEach((points, n) => {
      if (points.length === 0) return;
      const xy = points.map((p) => {
        const x = t1 > t0 ? ((p[0] - t0) / (t1 - t0)) * 88 : 88;
        const y = 26 - ((Number(p[1]) || 0) / top) * 24;
        return x.toFixed(1) + "," + y.toFixed(1);
      });
      const line = document.createElementNS(ns, "polyline");
      line.setAttribute("points", xy.join(" "));
      line.setAttribute("class", "s" + n);
      svg.appendChild(line);
    });
    const last = series[series.length - 1];
    if (last.length === 0) return;
    const value = Number(last[last.length - 1][1]) || 0;
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", "92");
    label.setAttribute("y", "18");
    label.textContent = value >= 100 ? String(Math.round(value)) : String(Math.round(value * 10) / 10);
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
      container.querySelectorAll("svg[data-chart]").forEach((svg) => {
        sparkline(svg, svg.dataset.chart.split(" ").map((name) => data.series[name] || []));
      });
    }
  }

  function running(jobs) {
    // The workers page's "Running now": one row per job (as text: never HTML), a queue job's key linked.
    const body = document.querySelector("#running-jobs tbody");
    if (!body) return;
    const base = document.body.dataset.base || "";
    const rows = jobs.map((j) => {
      const tr = document.createElement("tr");
      tr.dataset.runsOn = j.worker_id;
      ["worker", "queue", "key", "attempt", "running_for"].forEach((name) => {
        const td = document.createElement("td");
        if (name === "key" && !j.topic) {
          const a = document.createElement("a");
          a.href = base + "/message?" + new URLSearchParams({ queue: j.queue, key: j.key }).toString();
          a.textContent = j.key;
          td.appendChild(a);
        } else {
          td.textContent = String(j[name]);
        }
        if (name === "attempt" || name === "running_for") td.className = "num";
        tr.appendChild(td);
      });
      return tr;
    });
    if (rows.length === 0) {
      const tr = document.createElement("tr"), td = document.createElement("td");
      td.colSpan = 5;
      td.className = "muted";
      td.textContent = "Nothing running.";
      tr.appendChild(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  function apply(panel, data) {
    if (data.queues) {
      data.queues.forEach((q) => {
        const row = panel.querySelector('tr[data-queue="' + CSS.escape(q.queue) + '"]');
        if (row) fill(row, q);
      });
      const now = document.querySelector("[data-now]");
      if (now && data.now) now.textContent = data.now.replace(/\.\d+/, "");
    } else if (data.workers) {
      // Workers come and go: the rows are rebuilt (as text: never HTML).
      const body = panel.querySelector("tbody");
      const columns = Array.from(panel.querySelectorAll("thead th")).map((th) => th.dataset.column);
      const rows = data.workers.map((w) => {
        const tr = document.createElement("tr");
        tr.dataset.worker = w.id;
        tr.className = "worker " + w.state;
        columns.forEach((name) => {
          const td = document.createElement("td");
          td.textContent = w[name] === null || w[name] === undefined ? "-" : String(w[name]);
          if (name === "pid" || name === "slots" || name === "handled" || name === "running_now") td.className = "num";
          if (name === "state") td.dataset.field = "state";
          tr.appendChild(td);
        });
        return tr;
      });
      if (rows.length === 0) {
        const tr = document.createElement("tr"), td = document.createElement("td");
        td.colSpan = columns.length;
        td.className = "muted";
        td.textContent = "No worker has registered in the last hour.";
        tr.appendChild(td);
        rows.push(tr);
      }
      body.replaceChildren(...rows);
      if (data.running) running(data.running);
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

  function history(panel) {
    // The queue history's chart is drawn by the server (_history.html): load it, and again every 30 s.
    const load = () => {
      if (!document.hidden) {
        fetch(panel.dataset.history, { credentials: "same-origin", headers: { accept: "text/html" } })
          .then((r) => (r.ok ? r.text() : null))
          .then((html) => {
            const got = html && new DOMParser().parseFromString(html, "text/html").querySelector("[data-history]");
            if (got) { panel.replaceChildren(...got.childNodes); panel.dataset.loaded = String(Date.now()); }
          })
          .catch(() => {});
      }
      setTimeout(load, 30000);
    };
    load();
  }

  document.querySelectorAll("[data-history]").forEach(history);

  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  });
})();

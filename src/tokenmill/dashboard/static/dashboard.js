// The tokenmill dashboard: polls <page>/data and draws line charts on canvases (no library, no CDN).
"use strict";
(function () {
  const base = location.pathname.replace(/\/+$/, "");
  const MAX_POINTS = 3600;
  const COLORS = ["#3366cc", "#dc3912", "#109618", "#ff9900", "#990099", "#0099c6", "#dd4477", "#66aa00"];
  const pct = (v) => (v == null ? null : 100 * v);
  // Each chart: a title, a unit and its series (a label and how to read a point).
  const CHARTS = [
    { id: "ttft", title: "Time to first token", unit: "s", series: [["p50", (p) => p.ttft_p50], ["p99", (p) => p.ttft_p99]] },
    { id: "tpot", title: "Time per output token (per request)", unit: "s", series: [["p50", (p) => p.tpot_p50], ["p99", (p) => p.tpot_p99]] },
    { id: "itl", title: "Inter-token latency", unit: "s", series: [["p50", (p) => p.itl_p50], ["p99", (p) => p.itl_p99]] },
    { id: "e2e", title: "End-to-end latency", unit: "s", series: [["p50", (p) => p.e2e_p50], ["p99", (p) => p.e2e_p99]] },
    { id: "throughput", title: "Throughput", unit: "tok/s", series: [["output", (p) => p.output_tps], ["prompt", (p) => p.prompt_tps]] },
    { id: "requests", title: "Requests", unit: "", series: [["running", (p) => p.running], ["waiting", (p) => p.waiting]] },
    { id: "kv", title: "KV cache use", unit: "%", series: [["used", (p) => pct(p.kv_usage)]], max: 100 },
    { id: "prefix", title: "Prefix cache hit rate", unit: "%", series: [["hits / queries", (p) => pct(p.prefix_hit_rate)]], max: 100 },
    { id: "events", title: "Preemptions and rejections (per window)", unit: "", series: [["preemptions", (p) => p.preemptions], ["rejections", (p) => p.rejections]] },
    { id: "spec", title: "Speculative acceptance", unit: "%", series: [["accepted / drafted", (p) => pct(p.spec_acceptance)]], max: 100 },
    { id: "lora", title: "LoRA adapters: requests in flight", unit: "", series: "lora" },
    { id: "cost", title: "$ per million output tokens", unit: "$", series: [["at the current rate", (p) => p.cost_per_m_output]] },
  ];
  let points = [];
  let lastT = null;
  let selected = null;
  let sortBy = "e2e";

  // Request ids and finish reasons come from clients' requests: text, never markup.
  const esc = (v) => String(v).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

  function fmt(v, unit) {
    if (v == null || !isFinite(v)) return "–";
    if (unit === "s") return v < 1 ? (1000 * v).toFixed(v < 0.01 ? 2 : 1) + " ms" : v.toFixed(2) + " s";
    if (unit === "%") return v.toFixed(1) + " %";
    if (unit === "$") return "$" + v.toFixed(v < 1 ? 4 : 2);
    if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en-US");
    return Number.isInteger(v) ? String(v) : v.toFixed(2);
  }

  function seriesOf(chart) {
    if (chart.series !== "lora") return chart.series;
    const names = new Set();
    for (const p of points) for (const name of Object.keys(p.lora_in_flight || {})) names.add(name);
    return [...names].sort().map((name) => [name, (p) => (p.lora_in_flight || {})[name] ?? 0]);
  }

  function buildCharts() {
    const root = document.getElementById("charts");
    for (const chart of CHARTS) {
      const el = document.createElement("div");
      el.className = "chart";
      el.id = "chart-" + chart.id;
      el.innerHTML = `<h3>${chart.title}</h3><div class="legend"></div><canvas></canvas>`;
      root.appendChild(el);
      chart.el = el;
    }
  }

  function draw(chart) {
    const canvas = chart.el.querySelector("canvas");
    const legend = chart.el.querySelector(".legend");
    const series = seriesOf(chart);
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    canvas.width = w * dpr; canvas.height = h * dpr;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const left = 56, right = 8, top = 6, bottom = 18;
    const t1 = points.length ? points[points.length - 1].t : Date.now() / 1000;
    const t0 = points.length ? Math.min(points[0].t, t1 - 60) : t1 - 60;
    let ymax = chart.max || 0;
    for (const [, read] of series) for (const p of points) { const v = read(p); if (v != null && v > ymax) ymax = v; }
    if (!chart.max) ymax = ymax > 0 ? ymax * 1.1 : 1;
    const x = (t) => left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (w - left - right);
    const y = (v) => top + (1 - v / ymax) * (h - top - bottom);
    ctx.strokeStyle = "#e4e7ec"; ctx.fillStyle = "#6b7385"; ctx.lineWidth = 1; ctx.font = "10px sans-serif";
    for (let i = 0; i <= 4; i++) {
      const v = (ymax * i) / 4, yy = Math.round(y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(w - right, yy); ctx.stroke();
      ctx.textAlign = "right"; ctx.fillText(fmt(v, chart.unit), left - 4, yy + 3);
    }
    ctx.textAlign = "left"; ctx.fillText(new Date(t0 * 1000).toLocaleTimeString(), left, h - 4);
    ctx.textAlign = "right"; ctx.fillText(new Date(t1 * 1000).toLocaleTimeString(), w - right, h - 4);
    legend.innerHTML = "";
    series.forEach(([label, read], i) => {
      const color = COLORS[i % COLORS.length];
      ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
      let pen = false;
      for (const p of points) {
        const v = read(p);
        if (v == null) { pen = false; continue; }  // no observation in that window: a gap
        if (pen) ctx.lineTo(x(p.t), y(v)); else ctx.moveTo(x(p.t), y(v));
        pen = true;
      }
      ctx.stroke();
      let latest = null;
      for (let k = points.length - 1; k >= 0 && latest == null; k--) latest = read(points[k]);
      const item = document.createElement("span");
      item.innerHTML = `<span class="swatch" style="background:${color}"></span>${esc(label)} <span class="latest" data-series="${esc(chart.id + "-" + label)}">${fmt(latest, chart.unit)}</span>`;
      legend.appendChild(item);
    });
    if (!series.length) legend.textContent = chart.series === "lora" ? "no adapters" : "";
  }

  function showTotals(data) {
    const t = data.totals || {};
    for (const key of ["requests_finished", "output_tokens", "prompt_tokens", "preemptions", "rejections"]) {
      const el = document.getElementById("total-" + key);
      el.textContent = t[key] == null ? "–" : Math.round(t[key]).toLocaleString("en-US");
      el.dataset.value = t[key] == null ? "" : String(t[key]);
    }
    const now = points.length ? points[points.length - 1].cost_per_m_output : null;
    const noPrice = data.cost_per_hour == null ? "set --cost-per-hour" : "–";
    document.getElementById("total-cost_now").textContent = now == null ? noPrice : fmt(now, "$");
    const overall = t.cost_per_m_output_overall;
    document.getElementById("total-cost_overall").textContent = overall == null ? noPrice : fmt(overall, "$");
  }

  function showSlowest(rows) {
    const body = document.querySelector("#slowest tbody");
    body.innerHTML = "";
    for (const r of rows) {
      const tr = document.createElement("tr");
      tr.dataset.id = r.id;
      tr.title = r.id;
      if (r.id === selected) tr.className = "selected";
      const cells = [r.id, r.e2e, r.ttft, r.queue, r.prompt_tokens, r.output_tokens, r.preemptions, r.finish_reason];
      tr.innerHTML = cells.map((c, i) => `<td>${i >= 1 && i <= 3 ? (c == null ? "–" : c.toFixed(3)) : esc(c ?? "–")}</td>`).join("");
      tr.addEventListener("click", () => showTimeline(r.id));
      body.appendChild(tr);
    }
  }

  const PHASE_COLORS = { "to engine": "#9aa5b8", waiting: "#ff9900", prefill: "#dc3912", decode: "#3366cc", "to client": "#109618" };

  async function showTimeline(id) {
    selected = id;
    document.querySelectorAll("#slowest tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.id === id));
    document.getElementById("timeline-id").textContent = id;
    const root = document.getElementById("timeline");
    const res = await fetch(base + "/requests/" + encodeURIComponent(id));
    if (!res.ok) { root.textContent = (await res.json()).error.message; return; }  // textContent: no markup
    const d = await res.json();
    const end = Math.max(1e-6, ...d.phases.map((p) => p.end), ...d.marks.map((m) => m.t));
    const W = 560, rowH = 18, labelW = 80, H = d.phases.length * rowH + 28;
    const sx = (t) => labelW + (t / end) * (W - labelW - 10);
    let svg = `<svg id="timeline-svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}">`;
    d.phases.forEach((p, i) => {
      const y0 = 4 + i * rowH;
      svg += `<text x="0" y="${y0 + 12}">${p.name}</text>`;
      svg += `<rect class="phase" data-phase="${p.name}" x="${sx(p.start)}" y="${y0}" width="${Math.max(1, sx(p.end) - sx(p.start))}" height="${rowH - 4}" fill="${PHASE_COLORS[p.name] || "#888"}"><title>${p.name}: ${(1000 * (p.end - p.start)).toFixed(1)} ms</title></rect>`;
      svg += `<text x="${Math.min(W - 60, sx(p.end) + 4)}" y="${y0 + 12}">${fmt(p.end - p.start, "s")}</text>`;
    });
    const axisY = 4 + d.phases.length * rowH + 4;
    for (const m of d.marks) {
      const xx = sx(m.t);
      const color = m.name === "preempted" ? "#d00" : "#555";
      svg += `<line x1="${xx}" x2="${xx}" y1="0" y2="${axisY + 6}" stroke="${color}" stroke-dasharray="2,2"><title>${esc(m.name)} ${fmt(m.t, "s")} ${esc(m.note)}</title></line>`;
    }
    svg += `<text x="${labelW}" y="${axisY + 16}">0</text><text x="${W - 10}" y="${axisY + 16}" text-anchor="end">${fmt(end, "s")}</text></svg>`;
    const marks = d.marks.map((m) => `<tr><td>${fmt(m.t, "s")}</td><td>${esc(m.name)}</td><td>${esc(m.note)}</td></tr>`).join("");
    root.innerHTML = svg + `<table class="marks"><tbody>${marks}</tbody></table>`;
  }

  async function poll() {
    const status = document.getElementById("status");
    try {
      const url = base + "/data?sort=" + sortBy + (lastT == null ? "" : "&since=" + lastT);
      const res = await fetch(url, { cache: "no-store" });
      if (!res.ok) throw new Error("HTTP " + res.status);
      const data = await res.json();
      points = points.concat(data.points).slice(-MAX_POINTS);
      if (points.length) lastT = points[points.length - 1].t;
      for (const chart of CHARTS) draw(chart);
      showTotals(data);
      showSlowest(data.slowest);
      status.className = "status";
      status.textContent = `updated ${new Date().toLocaleTimeString()} · ${data.window_s} s windows`;
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
      setTimeout(poll, Math.max(500, 1000 * data.interval_s));
    } catch (err) {
      status.className = "status error";
      status.textContent = "cannot reach the server: " + err.message;
      setTimeout(poll, 2000);
    }
  }

  document.getElementById("sort").addEventListener("change", (e) => { sortBy = e.target.value; });
  window.addEventListener("resize", () => CHARTS.forEach(draw));
  buildCharts();
  poll();
})();

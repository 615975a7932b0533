// llmaccel's web page: a playground, a live dashboard and a benchmark viewer, with no build step.
// The data: /v1/chat/completions (streamed), /v1/llmaccel/stats (polled while the dashboard shows),
// /v1/llmaccel/results (the --ui-results-dir files). Charts are drawn on canvas by drawChart below.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("llmaccel-key") || "", model: null, messages: [], controller: null,
                history: [], polling: null, benchRuns: [] };
const COLORS = ["#0b5cad", "#d1242f", "#1a7f37", "#8250df", "#bf8700", "#0598bc", "#cf222e", "#57606a"];

// ---------- HTTP ----------
function authHeaders(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: authHeaders(options.body !== undefined) });
  if (response.status === 401) {
    $("key-form").hidden = false;
    throw new Error("this server needs an API key: enter it at the top of the page");
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).error.message; } catch (_) { /* not an error JSON */ }
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return response;
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

// ---------- tabs ----------
const TABS = ["playground", "dashboard", "benchmarks"];

function selectTab(name, focus) {
  for (const tab of TABS) {
    const on = tab === name;
    $("tab-" + tab).setAttribute("aria-selected", String(on));
    $("tab-" + tab).tabIndex = on ? 0 : -1;
    $(tab).hidden = !on;
  }
  if (focus) $("tab-" + name).focus();
  if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
  if (name === "dashboard") startPolling(); else stopPolling();
  if (name === "benchmarks" && state.model) loadResultList();  // the directory may have new files
}

function setUpTabs() {
  TABS.forEach((name, i) => {
    const tab = $("tab-" + name);
    tab.addEventListener("click", () => selectTab(name));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (step) selectTab(TABS[(i + step + TABS.length) % TABS.length], true);
    });
  });
  const fromHash = () => {
    const wanted = location.hash.slice(1);
    selectTab(TABS.includes(wanted) ? wanted : "playground");
  };
  window.addEventListener("hashchange", fromHash);
  fromHash();
}

// ---------- markdown (a small, escaping subset: code blocks, inline code, bold, italics, lists, headings) ----------
function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function inline(text) {
  return escapeHtml(text)
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
}

function renderMarkdown(source) {
  const out = [];
  const parts = source.split(/```/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {  // inside a fence: the first line names the language
      const newline = part.indexOf("\n");
      const lang = newline < 0 ? "" : part.slice(0, newline).trim();
      const code = newline < 0 ? part : part.slice(newline + 1);
      out.push(`<pre><code${lang ? ` class="language-${escapeHtml(lang)}"` : ""}>${escapeHtml(code)}</code></pre>`);
      return;
    }
    let list = null;
    for (const line of part.split("\n")) {
      const item = line.match(/^\s*(?:[-*]|(\d+)\.)\s+(.*)$/);
      if (item) {
        const kind = item[1] ? "ol" : "ul";
        if (list !== kind) { if (list) out.push(`</${list}>`); out.push(`<${kind}>`); list = kind; }
        out.push(`<li>${inline(item[2])}</li>`);
        continue;
      }
      if (list) { out.push(`</${list}>`); list = null; }
      const heading = line.match(/^(#{1,4})\s+(.*)$/);
      if (heading) out.push(`<h${heading[1].length + 2}>${inline(heading[2])}</h${heading[1].length + 2}>`);
      else if (line.trim()) out.push(`<p>${inline(line)}</p>`);
    }
    if (list) out.push(`</${list}>`);
  });
  return out.join("");
}

// ---------- playground ----------
function addTurn(role, text) {
  const li = document.createElement("li");
  li.className = role;
  li.innerHTML = `<div class="role">${role}</div><div class="content"></div><div class="meta"></div>`;
  li.querySelector(".content").innerHTML = renderMarkdown(text);
  $("conversation").append(li);
  return li;
}

function requestBody() {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const system = $("system-prompt").value.trim();
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  const body = { model: state.model, stream: true, stream_options: { include_usage: true },
                 messages: [...(system ? [{ role: "system", content: system }] : []), ...state.messages],
                 temperature: number("temperature"), top_p: number("top-p"), max_tokens: number("max-tokens"),
                 seed: number("seed") };
  if (stop.length) body.stop = stop;
  return body;
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function describeAnswer(m) {
  const parts = [];
  if (m.ttft !== undefined) parts.push(`TTFT ${m.ttft.toFixed(0)} ms`);
  if (m.usage) {
    const tokens = m.usage.completion_tokens;
    parts.push(`${tokens} tokens`);
    if (tokens > 1 && m.decodeMs > 0) parts.push(`${((tokens - 1) / (m.decodeMs / 1000)).toFixed(1)} tok/s`);
    const cached = (m.usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`prompt ${m.usage.prompt_tokens} tokens, ${cached} from the prefix cache`);
  }
  parts.push(`result cache: ${m.cache || "n/a"}`);
  parts.push(`input filter: ${m.inputFilter}`);
  if (m.guard) parts.push(`output guard: ${m.guard}`);
  if (m.finish) parts.push(`finish: ${m.finish}`);
  return parts.join(" · ");
}

async function send(text) {
  showError("");
  state.messages.push({ role: "user", content: text });
  addTurn("user", text);
  const li = addTurn("assistant", "");
  const content = li.querySelector(".content");
  const meta = { inputFilter: "passed" };
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop-generation").disabled = false;
  let answer = "";
  const start = performance.now();
  let first = null;
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(requestBody()),
                                                          signal: state.controller.signal });
    meta.cache = response.headers.get("x-llmaccel-cache");
    meta.guard = response.headers.get("x-llmaccel-guard");
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) meta.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta || {}).content || "";
        if (piece && first === null) { first = performance.now(); meta.ttft = first - start; }
        answer += piece;
        if (choice.finish_reason) meta.finish = choice.finish_reason;
      }
      content.innerHTML = renderMarkdown(answer);
    }
    meta.decodeMs = first === null ? 0 : performance.now() - first;
    state.messages.push({ role: "assistant", content: answer });
  } catch (error) {
    if (error.name === "AbortError") {
      meta.finish = "stopped";
      state.messages.push({ role: "assistant", content: answer });
    } else {
      if (String(error.message).includes("content filter")) meta.inputFilter = "blocked";
      state.messages.pop();  // the turn did not happen: the user may edit and resend it
      li.classList.add("error");
      content.textContent = "Error: " + error.message;
    }
  } finally {
    li.querySelector(".meta").textContent = describeAnswer(meta);
    state.controller = null;
    $("send").disabled = false;
    $("stop-generation").disabled = true;
  }
}

function setUpPlayground() {
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("message").value.trim();
    if (!text || state.controller) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("stop-generation").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => { state.messages = []; $("conversation").replaceChildren(); });
  $("copy").addEventListener("click", async () => {
    const text = state.messages.map((m) => `${m.role}: ${m.content}`).join("\n\n");
    try { await navigator.clipboard.writeText(text); } catch (_) { showError("the browser refused the clipboard"); }
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("api-key").value.trim();
    sessionStorage.setItem("llmaccel-key", state.key);
    $("key-form").hidden = true;
    showError("");
    loadModel();
  });
}

async function loadModel() {
  try {
    const models = await (await api("/v1/models")).json();
    state.model = models.data[0].id;
    const stats = await (await api("/v1/llmaccel/stats")).json();
    const c = stats.config;
    $("engine-summary").textContent = `${c.models.join(", ")} · ${c.device} ${c.dtype}` +
      `${c.quantization ? " " + c.quantization : ""} · ${c.kv_blocks} KV blocks of ${c.block_size} tokens · ` +
      `max ${c.max_num_seqs} sequences · context ${c.max_model_len}`;
    fillTable($("config"), Object.entries(c).map(([k, v]) => [k, v === null ? "off" : String(v)]));
  } catch (error) {
    showError(error.message);
  }
}

// ---------- charts ----------
function niceNumber(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Number.isInteger(value)) return String(value);  // counts read as counts: 3, not 3.00
  const abs = Math.abs(value);
  if (abs >= 1000) return value.toFixed(0);
  if (abs >= 10) return value.toFixed(1);
  return value.toFixed(2);
}

// series: [{name, points: [[x, y], ...]}]; x as seconds ago when opts.time
function drawChart(canvas, series, opts = {}) {
  canvas.chart = [series, opts];  // redrawn by the resize observer when the layout changes its width
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 320;
  const height = canvas.clientHeight || 180;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  const points = series.flatMap((s) => s.points.filter((p) => p[1] !== null && Number.isFinite(p[1])));
  const left = 48, right = 8, top = 8, bottom = 30;
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#57606a";
  if (!points.length) { ctx.fillText("no data yet", left, height / 2); return; }
  let [x0, x1] = [Math.min(...points.map((p) => p[0])), Math.max(...points.map((p) => p[0]))];
  let y1 = Math.max(...points.map((p) => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 <= 0) y1 = 1;
  y1 *= 1.1;
  const X = (x) => left + ((x - x0) / (x1 - x0)) * (width - left - right);
  const Y = (y) => top + (1 - y / y1) * (height - top - bottom);
  ctx.strokeStyle = "#d0d7de";
  ctx.beginPath();
  for (let i = 0; i <= 4; i++) {
    const y = (y1 * i) / 4;
    ctx.moveTo(left, Y(y)); ctx.lineTo(width - right, Y(y));
    ctx.fillText(niceNumber(y), 2, Y(y) + 4);
  }
  ctx.stroke();
  for (let i = 0; i <= 4; i++) {
    const x = x0 + ((x1 - x0) * i) / 4;
    ctx.fillText(opts.time ? `${Math.round(x)} s` : niceNumber(x), X(x) - 12, height - bottom + 14);
  }
  if (opts.xLabel) ctx.fillText(opts.xLabel, width / 2 - 30, height - 3);
  series.forEach((s, i) => {
    ctx.strokeStyle = ctx.fillStyle = s.color || COLORS[i % COLORS.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    for (const [x, y] of s.points) {
      if (y === null || !Number.isFinite(y)) { drawing = false; continue; }
      if (drawing) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
      drawing = true;
    }
    ctx.stroke();
    if (opts.markers) for (const [x, y] of s.points) if (Number.isFinite(y)) ctx.fillRect(X(x) - 2, Y(y) - 2, 4, 4);
    ctx.fillText(s.name, left + 6 + i * 110, top + 12);
  });
}

// A chart drawn before its grid gained a neighbour (or before a phone turned) keeps its old bitmap: redraw it.
const resizes = new ResizeObserver((entries) => {
  for (const { target } of entries) {
    if (target.chart && target.clientWidth && target.width !== Math.round(target.clientWidth * (window.devicePixelRatio || 1))) {
      drawChart(target, ...target.chart);
    }
  }
});

function chartFigure(container, id, caption) {
  let figure = document.getElementById(id);
  if (!figure) {
    figure = document.createElement("figure");
    figure.id = id;
    figure.innerHTML = `<canvas role="img" aria-label="${escapeHtml(caption)}"></canvas>` +
      `<figcaption>${escapeHtml(caption)}</figcaption>`;
    container.append(figure);
    resizes.observe(figure.querySelector("canvas"));
  }
  return figure.querySelector("canvas");
}

function fillTable(table, rows) {
  const body = table.tBodies[0];
  body.replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    tr.innerHTML = `<th scope="row">${escapeHtml(k)}</th><td>${escapeHtml(String(v))}</td>`;
    return tr;
  }));
}

// ---------- dashboard ----------
const CARDS = [
  ["output_tokens_per_s", "output tokens/s", (s) => s.rates.output_tokens_per_s],
  ["requests_per_s", "requests/s", (s) => s.rates.requests_per_s],
  ["running", "running sequences", (s) => s.engine.running],
  ["waiting", "waiting sequences", (s) => s.engine.waiting],
  ["kv_cache_usage", "KV cache used %", (s) => 100 * s.engine.kv_cache_usage],
  ["prefix_hit_rate", "prefix-cache hit %", (s) => (s.prefix_cache.hit_rate === null ? null : 100 * s.prefix_cache.hit_rate)],
  ["ttft_p50", "TTFT p50 ms", (s) => s.latency.ttft.p50_ms],
  ["ttft_p99", "TTFT p99 ms", (s) => s.latency.ttft.p99_ms],
  ["tpot_p50", "TPOT p50 ms", (s) => s.latency.tpot.p50_ms],
  ["tpot_p99", "TPOT p99 ms", (s) => s.latency.tpot.p99_ms],
  ["preemptions", "preemptions", (s) => s.totals.preemptions],
  ["rejected", "rejected requests", (s) => Object.values(s.totals.rejected).reduce((a, b) => a + b, 0)],
  ["guard_anomalies", "guard anomalies", (s) => s.totals.guard_anomalies],
  ["quality", "perplexity change %", (s) => (s.quality.perplexity_change_ratio === null ? null
                                                : 100 * s.quality.perplexity_change_ratio)],
];
const CHARTS = [
  ["chart-tokens", "output tokens/s", ["output_tokens_per_s"]],
  ["chart-requests", "requests/s", ["requests_per_s"]],
  ["chart-sequences", "running and waiting sequences", ["running", "waiting"]],
  ["chart-kv", "KV cache used % and prefix-cache hit %", ["kv_cache_usage", "prefix_hit_rate"]],
  ["chart-ttft", "TTFT p50 / p99 (ms, sliding window)", ["ttft_p50", "ttft_p99"]],
  ["chart-tpot", "TPOT p50 / p99 (ms, sliding window)", ["tpot_p50", "tpot_p99"]],
];

function setUpDashboard() {
  $("cards").innerHTML = CARDS.map(([id, label]) =>
    `<div class="card"><div class="label" id="label-${id}">${label}</div>` +
    `<div class="value" id="card-${id}" aria-labelledby="label-${id}">–</div></div>`).join("");
}

async function pollOnce() {
  if (document.hidden) return;  // a background tab asks nothing of the server
  try {
    const stats = await (await api("/v1/llmaccel/stats")).json();
    const now = Date.now() / 1000;
    const row = { t: now };
    for (const [id, , read] of CARDS) {
      row[id] = read(stats);
      $("card-" + id).textContent = niceNumber(row[id]);
    }
    state.history.push(row);
    while (state.history.length > 120) state.history.shift();
    for (const [id, caption, keys] of CHARTS) {
      const labels = Object.fromEntries(CARDS.map(([k, label]) => [k, label]));
      drawChart(chartFigure($("charts"), id, caption), keys.map((k) => ({
        name: labels[k], points: state.history.map((r) => [r.t - now, r[k]]) })), { time: true });
    }
    const t = stats.totals;
    fillTable($("totals"), [
      ["requests finished", t.requests_finished], ["tokens generated", t.generation_tokens],
      ["rejected, by reason", JSON.stringify(t.rejected)], ["rate limited", JSON.stringify(t.rate_limited)],
      ["aborted (client left)", t.aborted], ["timed out", t.timed_out],
      ["input filter matches", JSON.stringify(t.input_filter_matches)], ["guard checks", t.guard_checks],
      ["result-cache hits", t.result_cache_hits],
      ["prefix-cache hit rate since start", stats.prefix_cache.hit_rate_total === null ? "–"
        : (100 * stats.prefix_cache.hit_rate_total).toFixed(1) + " %"],
      ...Object.entries(stats.kv_tiers || {}).map(([tier, k]) => [`KV ${tier} tier`,
        `${k.files} blocks (${(k.disk_bytes / 2 ** 30).toFixed(2)} GiB); written ${k.stored_blocks}` +
        (k.mean_store_ms === null ? "" : ` (${k.mean_store_ms.toFixed(2)} ms each)`) +
        `, read back ${k.loaded_blocks}` + (k.mean_load_ms === null ? "" : ` (${k.mean_load_ms.toFixed(2)} ms each)`) +
        `, refused ${k.rejected_files}, failed writes ${k.store_errors}`])]);
    showError("");
  } catch (error) {
    showError("dashboard: " + error.message);
  }
}

function startPolling() {
  if (state.polling) return;
  pollOnce();
  state.polling = setInterval(pollOnce, 1000);
}

function stopPolling() {
  clearInterval(state.polling);
  state.polling = null;
}

// ---------- benchmarks ----------
function parseJsonLenient(text) {
  // Python's json writes Infinity and NaN (a request rate of inf); JSON.parse does not read them
  return JSON.parse(text.replace(/([:[,]\s*)-?(?:Infinity|NaN)(?=\s*[,\]}])/g, "$1null"));
}

function runsOf(name, text) {
  let data;
  try { data = parseJsonLenient(text); } catch (error) { throw new Error(`${name}: not JSON (${error.message})`); }
  if (data && typeof data.output_throughput === "number" && typeof data.median_ttft_ms === "number") {
    return [{ kind: "serve", file: name, label: data.label || name, concurrency: data.max_concurrency,
              rate: data.request_rate, requests: data.request_throughput, tokens: data.output_throughput,
              ttft50: data.median_ttft_ms, ttft99: data.p99_ttft_ms, tpot50: data.median_tpot_ms,
              tpot99: data.p99_tpot_ms, failed: data.failed }];
  }
  if (data && Array.isArray(data.results) && data.results.length &&
      data.results.every((r) => typeof r.output_tokens_per_s === "number")) {
    return data.results.map((r) => ({ kind: "offline", file: name, label: r.system || name, concurrency: r.num_prompts,
                                      tokens: r.output_tokens_per_s }));
  }
  throw new Error(`${name}: not a result of bench serve, bench sweep or bench offline ` +
                  "(no output_throughput and median_ttft_ms, nor results[].output_tokens_per_s)");
}

function addBenchFiles(files) {
  const errors = [];
  for (const [name, text] of files) {
    try {
      const runs = runsOf(name, text);
      state.benchRuns = state.benchRuns.filter((r) => r.file !== name).concat(runs);  // a file loaded again: its new runs
    } catch (error) { errors.push(error.message); }
  }
  $("bench-error").textContent = errors.join("\n");
  $("bench-error").hidden = !errors.length;
  drawBenchmarks();
}

function drawBenchmarks() {
  const runs = state.benchRuns;
  const serve = runs.filter((r) => r.kind === "serve");
  const labels = [...new Set(serve.map((r) => r.label))];
  const curve = (key) => labels.map((label) => ({ name: label, points: serve.filter((r) => r.label === label)
    .sort((a, b) => a.tokens - b.tokens).map((r) => [r.tokens, r[key]]) }));
  if (serve.length) {
    drawChart(chartFigure($("bench-charts"), "bench-tpot", "median TPOT (ms) against output tokens/s"),
              curve("tpot50"), { markers: true, xLabel: "output tokens/s" });
    drawChart(chartFigure($("bench-charts"), "bench-ttft", "median TTFT (ms) against output tokens/s"),
              curve("ttft50"), { markers: true, xLabel: "output tokens/s" });
  }
  const offline = runs.filter((r) => r.kind === "offline");
  if (offline.length) {
    drawChart(chartFigure($("bench-charts"), "bench-offline", "offline output tokens/s by system"),
              [...new Set(offline.map((r) => r.label))].map((label) => ({ name: label,
                points: offline.filter((r) => r.label === label).map((r) => [r.concurrency, r.tokens]) })),
              { markers: true, xLabel: "prompts" });
  }
  const columns = ["file", "label", "concurrency", "rate", "requests", "tokens", "ttft50", "ttft99", "tpot50",
                   "tpot99", "failed"];
  const names = { requests: "req/s", tokens: "output tok/s", ttft50: "TTFT p50 ms", ttft99: "TTFT p99 ms",
                  tpot50: "TPOT p50 ms", tpot99: "TPOT p99 ms" };
  $("bench-table").tHead.innerHTML = "<tr>" + columns.map((c) => `<th scope="col">${names[c] || c}</th>`).join("") + "</tr>";
  const ordered = [...runs].sort((a, b) => String(a.label).localeCompare(String(b.label)) ||
                                            (a.concurrency ?? 0) - (b.concurrency ?? 0) || (a.rate ?? 0) - (b.rate ?? 0));
  $("bench-table").tBodies[0].replaceChildren(...ordered.map((r) => {
    const tr = document.createElement("tr");
    tr.innerHTML = columns.map((c) => {
      const v = r[c];
      return `<td>${escapeHtml(typeof v === "number" ? niceNumber(v) : v === undefined || v === null ? "–" : String(v))}</td>`;
    }).join("");
    return tr;
  }));
}

function setUpBenchmarks() {
  $("bench-files").addEventListener("change", async (event) => {
    const files = await Promise.all([...event.target.files].map(async (f) => [f.name, await f.text()]));
    addBenchFiles(files);
  });
  $("bench-dir-load").addEventListener("click", async () => {
    const names = [...$("bench-dir-list").selectedOptions].map((o) => o.value);
    const files = await Promise.all(names.map(async (name) =>
      [name, await (await api("/v1/llmaccel/results/" + encodeURIComponent(name))).text()]));
    addBenchFiles(files);
  });
}

async function loadResultList() {
  try {
    const listing = await (await api("/v1/llmaccel/results")).json();
    $("bench-dir").hidden = !listing.files.length;
    if (!listing.files.length) return;
    $("bench-dir-list").replaceChildren(...listing.files.map((name) => new Option(name, name)));
    $("bench-dir").hidden = false;
  } catch (error) {
    showError(error.message);
  }
}

setUpTabs();
setUpPlayground();
setUpDashboard();
setUpBenchmarks();
loadModel().then(loadResultList);

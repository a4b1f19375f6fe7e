// rstreamer dashboard: polls /api/state and redraws. Plain JS, no framework, no build step.
// Everything from Redis is inserted with textContent, never as HTML: payload previews are user data.
"use strict";

const session = { csrf: null, allowActions: false, interval: 1000 };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function sparkline(values, testid) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 100 30");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("data-testid", testid);
  const top = Math.max(1e-9, ...values);
  const step = values.length > 1 ? 100 / (values.length - 1) : 0;
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", values.map((v, i) => `${(i * step).toFixed(2)},${(29 - 28 * v / top).toFixed(2)}`).join(" "));
  svg.append(line);
  return svg;
}

function card(label, value, testid, series, bad) {
  const box = el("div", { class: bad ? "card bad" : "card" },
    el("div", { class: "label" }, label), el("div", { class: "value", "data-testid": testid }, value));
  if (series) box.append(sparkline(series, `${testid}-spark`));
  return box;
}

function table(columns, rows, testid, emptyText) {
  if (!rows.length) return el("p", { class: "empty", "data-testid": testid }, emptyText);
  const head = el("tr", {}, ...columns.map(c => el("th", {}, c)));
  return el("table", { "data-testid": testid }, el("thead", {}, head), el("tbody", {}, ...rows));
}

function workerRow(w) {
  return el("tr", { "data-testid": "worker", "data-pid": w.pid },
    el("td", {}, w.host ?? "-"), el("td", {}, w.pid ?? "-"), el("td", {}, w.gpu ?? "cpu"),
    el("td", {}, w.batches), el("td", {}, w.items), el("td", {}, w.errors), el("td", {}, w.pending),
    el("td", {}, `${w.last_seen_s.toFixed(1)} s ago`));
}

async function act(prefix, verb, ids) {
  const response = await fetch(`/api/prefixes/${encodeURIComponent(prefix)}/dead/${verb}`, {
    method: "POST", headers: { "Content-Type": "application/json", "X-CSRF-Token": session.csrf },
    body: JSON.stringify({ ids }),
  });
  if (!response.ok) showError(`${verb} failed: ${(await response.json()).error}`);
  await refresh();
}

function deadRow(prefix, d) {
  const row = el("tr", { "data-testid": "dead-letter", "data-id": d.id },
    el("td", {}, new Date(d.at_ms).toLocaleTimeString()), el("td", {}, d.reason),
    el("td", { class: "preview", title: d.preview }, d.preview), el("td", {}, d.worker));
  if (session.allowActions) {
    row.append(el("td", {},
      el("button", { "data-testid": "replay", onclick: () => act(prefix, "replay", [d.id]) }, "replay"),
      el("button", { "data-testid": "purge", onclick: () => act(prefix, "purge", [d.id]) }, "purge")));
  }
  return row;
}

function prefixSection(p) {
  const h = p.history;
  const cards = el("div", { class: "cards" },
    card("queue depth", p.queue_length, "queue", h.queue_length),
    card("oldest wait (s)", p.oldest_wait_s.toFixed(2), "oldest-wait", h.oldest_wait_s),
    card("items/s", p.throughput.items_per_s.toFixed(1), "items-per-s", h.items_per_s),
    card("pending", p.pending, "pending"),
    card("live workers", p.workers.length, "live-workers", null, p.workers.length === 0),
    card("dead letters", p.dead_letters, "dead-count", null, p.dead_letters > 0));
  const deadColumns = ["when", "reason", "payload", "worker"].concat(session.allowActions ? ["action"] : []);
  const idle = p.state === "idle" ? el("span", { class: "state idle", "data-testid": "idle",
    title: "no live worker and nothing queued: `rstreamer forget " + p.prefix + "` deletes a prefix nobody uses" },
    "idle") : "";
  return el("section", { class: "prefix " + p.state, "data-testid": "prefix", "data-prefix": p.prefix },
    el("h2", {}, p.prefix, idle), cards,
    el("h3", {}, "workers"),
    table(["host", "pid", "gpu", "batches", "items", "errors", "pending", "last seen"],
      p.workers.map(workerRow), "workers", "no live worker"),
    el("h3", {}, "dead letters (newest first)"),
    table(deadColumns, p.dead.map(d => deadRow(p.prefix, d)), "dead", "none"));
}

function showError(text) {
  const box = document.getElementById("error");
  box.hidden = !text;
  box.textContent = text || "";
}

async function refresh() {
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    const state = await response.json();
    session.interval = 1000 * state.interval;
    showError(state.error);
    const sections = state.prefixes.map(prefixSection);
    document.getElementById("prefixes").replaceChildren(...(sections.length ? sections
      : [el("p", { class: "empty" }, "no prefix found (no request stream in this Redis yet)")]));
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    showError(`dashboard server unreachable: ${err}`);
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, session.interval);
}

async function start() {
  const info = await (await fetch("/api/session")).json();
  session.csrf = info.csrf;
  session.allowActions = info.allow_actions;
  document.getElementById("mode").textContent = info.allow_actions ? "actions allowed" : "read-only";
  loop();
}

start();

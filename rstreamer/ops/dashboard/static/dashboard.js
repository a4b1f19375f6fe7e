// rstreamer dashboard: polls /api/state and updates the page in place. Plain JS, no framework, no build step.
//
// Every node is built once and then only its text (or an attribute) changes, and only when the value
// did: a selection stays selected, a row being read does not jump, nothing flickers. Rows are keyed
// (a worker by name, a job or a dead letter by id, a level by number) and added or removed as such.
// Everything from Redis is inserted with textContent, never as HTML: payload previews are user data.
"use strict";

const session = { csrf: null, allowActions: false, interval: 1000, pending: null };

// --- building blocks ---------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function setText(node, text) {
  const value = String(text);
  if (node.textContent !== value) node.textContent = value;
}

function setAttr(node, name, value) {
  if (node.getAttribute(name) !== String(value)) node.setAttribute(name, value);
}

function toggle(node, name, on) {
  if (node.classList.contains(name) !== Boolean(on)) node.classList.toggle(name, Boolean(on));
}

// Keep the children of `parent` one per item, in order: `make(item)` builds a new one, `update(node,
// item)` refreshes one; a node whose key is gone is removed. Existing nodes are never rebuilt.
function syncChildren(parent, items, keyOf, make, update) {
  const existing = new Map([...parent.children].map(node => [node.dataset.key, node]));
  let at = 0;
  for (const item of items) {
    const key = String(keyOf(item));
    let node = existing.get(key);
    if (!node) {
      node = make(item);
      node.dataset.key = key;
    }
    existing.delete(key);
    update(node, item);
    if (parent.children[at] !== node) parent.insertBefore(node, parent.children[at] || null);
    at += 1;
  }
  for (const node of existing.values()) node.remove();
}

const SVG = "http://www.w3.org/2000/svg";

function sparkline(testid) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 100 30");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("data-testid", testid);
  svg.append(document.createElementNS(SVG, "polyline"));
  return svg;
}

function drawSparkline(svg, values, nullIsTop) {
  // null is "nothing measured" (drawn at 0), or for a drain time an unbounded one (drawn at the top).
  const finite = values.filter(v => v !== null);
  const top = Math.max(1e-9, ...finite);
  const step = values.length > 1 ? 100 / (values.length - 1) : 0;
  const y = v => (v === null ? (nullIsTop ? top : 0) : v);
  const points = values.map((v, i) => `${(i * step).toFixed(2)},${(29 - 28 * y(v) / top).toFixed(2)}`);
  setAttr(svg.firstChild, "points", points.join(" "));
}

// --- formatting --------------------------------------------------------------------------------

function fullTime(ms) {
  return ms ? new Date(ms).toISOString().replace("T", " ").replace("Z", " UTC") : "-";
}

function fullTimeOfSeconds(seconds) {
  return seconds ? fullTime(seconds * 1000) : "-";
}

function ms(value) {
  return value === null || value === undefined ? "-" : value < 10 ? value.toFixed(1) : value.toFixed(0);
}

function seconds(value) {
  if (value === null || value === undefined) return "-";
  return value < 10 ? `${value.toFixed(2)} s` : `${value.toFixed(0)} s`;
}

function drainText(drain) {
  if (!drain.backlog) return "0 s";
  if (drain.seconds === null) return "unbounded";
  return seconds(drain.seconds);
}

// --- one prefix --------------------------------------------------------------------------------

const CARDS = [
  // key (data-testid of the value), label, value, sparkline series, bad when
  ["queue", "queue depth", p => p.queue_length, "queue_length"],
  ["oldest-wait", "oldest wait (s)", p => p.oldest_wait_s.toFixed(2), "oldest_wait_s"],
  ["items-per-s", "items/s", p => p.throughput.items_per_s.toFixed(1), "items_per_s"],
  ["latency", "caller latency p50 / p99 (ms)", p => `${ms(p.pace.latency_p50_ms)} / ${ms(p.pace.latency_p99_ms)}`,
    "latency_p99_ms"],
  ["queue-wait", "queue wait p50 / p99 (ms)", p => `${ms(p.pace.wait_p50_ms)} / ${ms(p.pace.wait_p99_ms)}`],
  ["batch", "mean batch / limit", p => `${p.pace.batch_mean ?? "-"} / ${p.pace.batch_limit ?? "-"}`],
  ["drain", "drain time", p => drainText(p.drain), "drain_s", p => p.drain.backlog > 0 && p.drain.seconds === null],
  ["pending", "pending", p => p.pending],
  ["live-workers", "live workers", p => p.workers.length, null, p => p.workers.length === 0],
  ["dead-count", "dead letters", p => p.dead_letters, null, p => p.dead_letters > 0],
];

const CARD_TITLES = {
  latency: "per item, from its XADD to its reply in Redis (what a caller waits, less one network hop), "
    + "over the last 30 s",
  "queue-wait": "per item, from its XADD to its batch starting, over the last 30 s",
  batch: "items per batch over the last 30 s, against the largest batch the workers run",
  drain: "the backlog (waiting and pending) times the mean cost per item, over the live workers' measured capacity",
};

function card([key, label, , series]) {
  const box = el("div", { class: "card", "data-card": key, title: CARD_TITLES[key] || "" },
    el("div", { class: "label" }, label), el("div", { class: "value", "data-testid": key }, ""));
  if (series) box.append(sparkline(`${key}-spark`));
  return box;
}

function updateCards(cards, p) {
  for (const [key, , value, series, bad] of CARDS) {
    const box = cards.querySelector(`[data-card="${key}"]`);
    setText(box.querySelector(".value"), value(p));
    toggle(box, "bad", bad && bad(p));
    if (series) drawSparkline(box.querySelector("svg"), p.history[series], series === "drain_s");
  }
}

function tableBlock(testid, columns, emptyText) {
  // A wrapper marked .empty when there is no row (so tests and styles can tell).
  const body = el("tbody");
  const table = el("table", {}, el("thead", {}, el("tr", {}, ...columns.map(c => el("th", {}, c)))), body);
  return el("div", { class: "rows", "data-testid": testid }, table, el("p", { class: "empty-text" }, emptyText));
}

function syncTable(block, items, keyOf, make, update) {
  syncChildren(block.querySelector("tbody"), items, keyOf, make, update);
  toggle(block, "empty", items.length === 0);
}

function cells(row, values) {
  values.forEach((value, i) => setText(row.children[i], value));
}

function levelRow() {
  return el("tr", { "data-testid": "level" }, ...Array.from({ length: 7 }, () => el("td")));
}

function updateLevel(row, level) {
  setAttr(row, "data-level", level.level);
  cells(row, [level.level, level.weight, level.queue_length, level.held, level.pending,
    level.oldest_wait_s.toFixed(2), level.drain_s === null ? "unbounded" : seconds(level.drain_s)]);
}

function workerRow(w) {
  const row = el("tr", { "data-testid": "worker", "data-pid": w.pid }, ...Array.from({ length: 11 }, () => el("td")));
  row.children[9].setAttribute("data-testid", "restarts");
  return row;
}

function restartsText(w) {
  if (w.restarts === null || w.restarts === undefined) return "-";
  if (!w.restarts) return "0";
  return `${w.restarts} (last: ${w.last_exit}, ${fullTimeOfSeconds(w.last_exit_at)})`;
}

function updateWorker(row, w) {
  cells(row, [w.host ?? "-", w.pid ?? "-", w.slot ?? "-", w.gpu ?? "cpu", w.batches, w.items, w.errors, w.pending,
    w.items_per_busy_s === null ? "-" : w.items_per_busy_s.toFixed(1), restartsText(w), `${w.last_seen_s.toFixed(1)} s ago`]);
  row.title = `${w.name}; started ${fullTimeOfSeconds(w.started)}`;
}

function jobRow() {
  const row = el("tr", { "data-testid": "job" }, ...Array.from({ length: 6 }, () => el("td")));
  row.children[2].append(el("progress"), el("span"));
  return row;
}

function updateJob(row, job) {
  setAttr(row, "data-status", job.status);
  setText(row.children[0], job.job_id);
  setText(row.children[1], job.status);
  const progress = row.children[2].querySelector("progress");
  setAttr(progress, "max", Math.max(1, job.total));
  setAttr(progress, "value", job.done + job.failed);
  setText(row.children[2].querySelector("span"), ` ${job.done + job.failed} / ${job.total}`);
  setText(row.children[3], job.failed);
  setText(row.children[4], fullTimeOfSeconds(job.created));
  setText(row.children[5], fullTimeOfSeconds(job.finished));
  toggle(row, "bad", job.status === "failed");
}

function deadRow(prefix) {
  return (letter) => {
    const row = el("tr", { "data-testid": "dead-letter", "data-id": letter.id },
      el("td", { class: "id" }), el("td"), el("td"), el("td", { class: "preview" }), el("td"), el("td"));
    if (session.allowActions) {
      row.append(el("td", {},
        el("button", { "data-testid": "replay", onclick: () => askFirst(prefix, "replay", [letter.id]) }, "replay"),
        el("button", { "data-testid": "purge", onclick: () => askFirst(prefix, "purge", [letter.id]) }, "purge")));
    }
    return row;
  };
}

function updateDead(row, letter) {
  cells(row, [letter.id, fullTime(letter.at_ms), letter.reason, letter.preview, letter.deliveries ?? "-",
    letter.worker ?? "-"]);
  setAttr(row.children[3], "title", letter.preview);
  setAttr(row, "title", `entry ${letter.entry} of the request stream`);
}

function prefixSection(p) {
  const deadColumns = ["id", "when", "reason", "payload", "deliveries", "worker"]
    .concat(session.allowActions ? ["action"] : []);
  return el("section", { class: "prefix", "data-testid": "prefix", "data-prefix": p.prefix },
    el("h2", {}, el("span", { class: "name" }, p.prefix), el("span", { class: "state", "data-testid": "state" })),
    el("p", { class: "alert", "data-testid": "prefix-alert", hidden: "" }),
    el("div", { class: "cards" }, ...CARDS.map(card)),
    el("h3", {}, "priority levels"),
    tableBlock("levels", ["level", "weight", "waiting", "held", "pending", "oldest wait (s)", "drain time"], "none"),
    el("h3", {}, "workers"),
    tableBlock("workers", ["host", "pid", "slot", "gpu", "batches", "items", "errors", "pending", "items/s busy",
      "restarts", "last seen"], "none"),
    el("h3", {}, "jobs (newest first)"),
    el("p", { class: "summary", "data-testid": "jobs-summary" }),
    tableBlock("jobs", ["id", "status", "progress", "failed", "created", "finished"], "none"),
    el("h3", {}, "dead letters (newest first)"),
    el("div", { class: "confirm", "data-testid": "confirm", hidden: "" }),
    tableBlock("dead", deadColumns, "none"));
}

// One clear sentence when no worker serves the prefix: what happens to calls, and what waits.
function prefixState(p) {
  if (p.workers.length) return ["serving", `${p.workers.length} live worker${p.workers.length > 1 ? "s" : ""}`, ""];
  const backlog = p.queue_length + p.pending;
  if (p.shelf) return ["idle", `cold (shelf ${p.shelf})`, ""];  // a shelf worker loads it on its next call
  if (!backlog) return ["idle", "idle", ""];
  return ["unserved", "no live worker",
    `No live worker serves ${p.prefix}: ${backlog} item${backlog > 1 ? "s" : ""} wait. Calls fail with NoLiveWorker `
    + "(HTTP 503), or wait for a worker to start where a cold-start wait is set."];
}

function updatePrefix(section, p, stale) {
  const [state, badge, alert] = prefixState(p);
  for (const name of ["serving", "idle", "unserved"]) toggle(section, name, name === state);
  const badgeNode = section.querySelector('[data-testid="state"]');
  setText(badgeNode, badge);
  setAttr(badgeNode, "title", state === "idle"
    ? `no live worker and nothing queued: \`rstreamer forget ${p.prefix}\` deletes a prefix nobody uses` : "");
  const alertNode = section.querySelector('[data-testid="prefix-alert"]');
  setText(alertNode, alert);
  alertNode.hidden = !alert || stale;  // with Redis unreachable, the page says that one thing
  updateCards(section.querySelector(".cards"), p);
  syncTable(section.querySelector('[data-testid="levels"]'), p.levels, l => l.level, levelRow, updateLevel);
  syncTable(section.querySelector('[data-testid="workers"]'), p.workers, w => w.name, workerRow, updateWorker);
  const jobs = p.jobs || { running: 0, failed: 0, recent: [] };
  setText(section.querySelector('[data-testid="jobs-summary"]'),
    jobs.recent.length ? `${jobs.running} running, ${jobs.failed} failed (of the ${jobs.recent.length} newest)` : "");
  syncTable(section.querySelector('[data-testid="jobs"]'), jobs.recent, j => j.job_id, jobRow, updateJob);
  syncTable(section.querySelector('[data-testid="dead"]'), p.dead, d => d.id, deadRow(p.prefix), updateDead);
}

// --- the shelves of models -------------------------------------------------------------------------
// /api/state carries `shelf`: null without a shelf, else one object per shelf (rstreamer.ops.shelves):
// its live workers with the models each holds, and per model its holders, backlog, loads and load time.

function shelfWorkerRow() {
  return el("tr", { "data-testid": "shelf-worker" }, ...Array.from({ length: 7 }, () => el("td")));
}

function updateShelfWorker(row, w) {
  const busy = [["loading", w.loading], ["refusing", w.refusing]].filter(([, list]) => list.length)
    .map(([kind, list]) => `${kind} ${list.join(", ")}`).join("; ");
  setAttr(row, "data-pid", w.pid);
  cells(row, [w.host ?? "-", w.pid ?? "-", `${w.held.length} / ${w.slots}`, w.held.join(", ") || "-", busy || "-",
    w.loads, w.evictions]);
  row.title = w.name;
}

function shelfModelRow() {
  return el("tr", { "data-testid": "shelf-model" }, ...Array.from({ length: 10 }, () => el("td")));
}

function updateShelfModel(row, m) {
  const holders = m.holders.length ? m.holders.length : m.loading.length ? "loading" : "cold";
  setAttr(row, "data-model", m.model);
  cells(row, [m.model, holders, m.backlog, m.oldest_wait_s.toFixed(2), m.loads, m.evictions, seconds(m.load_s),
    m.bytes ? `${(m.bytes / 2 ** 20).toFixed(1)} MiB` : "-", m.waited, m.error ?? ""]);
  row.title = m.holders.join(", ");
  toggle(row, "bad", Boolean(m.error));
}

function shelfSection(shelf) {
  return el("section", { class: "prefix shelf", "data-testid": "shelf-section", "data-shelf": shelf.shelf },
    el("h2", {}, el("span", { class: "name" }, `shelf ${shelf.shelf}`)),
    el("h3", {}, "shelf workers"),
    tableBlock("shelf-workers", ["host", "pid", "slots used", "holds", "busy", "loads", "evictions"], "no live shelf worker"),
    el("h3", {}, "models"),
    tableBlock("shelf-models", ["model", "holders", "backlog", "oldest wait (s)", "loads", "evictions", "load time",
      "resident", "waited for a load", "failure"], "none"));
}

function updateShelfSection(section, shelf) {
  syncTable(section.querySelector('[data-testid="shelf-workers"]'), shelf.workers, w => w.name, shelfWorkerRow,
    updateShelfWorker);
  syncTable(section.querySelector('[data-testid="shelf-models"]'), shelf.models, m => m.model, shelfModelRow,
    updateShelfModel);
}

function updateShelf(shelf) {
  const section = document.getElementById("shelf");
  section.hidden = shelf === null || shelf === undefined || shelf.length === 0;
  syncChildren(section, shelf || [], s => s.shelf, shelfSection, updateShelfSection);
}

// --- actions: confirm first, then say what was done -----------------------------------------------

const VERBS = {
  replay: { ask: "Replay", done: "Replayed", effect: "it goes back on the prefix's request stream with a fresh deadline, and its answer to its reply key" },
  purge: { ask: "Purge", done: "Purged", effect: "it is deleted for good" },
};

function askFirst(prefix, verb, ids) {
  const section = document.querySelector(`section.prefix[data-prefix="${CSS.escape(prefix)}"]`);
  const box = section.querySelector('[data-testid="confirm"]');
  const what = `${ids.length} dead letter${ids.length > 1 ? "s" : ""} of ${prefix} (${ids.join(", ")})`;
  box.replaceChildren(
    el("span", {}, `${VERBS[verb].ask} ${what}? ${VERBS[verb].effect[0].toUpperCase()}${VERBS[verb].effect.slice(1)}.`),
    el("button", { "data-testid": "confirm-yes", onclick: () => { box.hidden = true; act(prefix, verb, ids); } },
      VERBS[verb].ask),
    el("button", { "data-testid": "confirm-no", onclick: () => { box.hidden = true; } }, "Cancel"));
  box.hidden = false;
}

async function act(prefix, verb, ids) {
  try {
    const response = await fetch(`/api/prefixes/${encodeURIComponent(prefix)}/dead/${verb}`, {
      method: "POST", headers: { "Content-Type": "application/json", "X-CSRF-Token": session.csrf },
      body: JSON.stringify({ ids }),
    });
    const body = await response.json();
    if (!response.ok) showNotice(`${VERBS[verb].ask} failed: ${body.error}`, true);
    else if (!body.done) showNotice(`Nothing to ${verb}: ${ids.join(", ")} of ${prefix} is gone already.`, true);
    else showNotice(`${VERBS[verb].done} ${body.done} dead letter${body.done > 1 ? "s" : ""} of ${prefix}: ${ids.join(", ")}.`);
  } catch (err) {
    showNotice(`${VERBS[verb].ask} failed: ${err}`, true);
  }
  await refresh();
}

function showNotice(text, bad) {
  const box = document.getElementById("notice");
  setText(box, text);
  toggle(box, "bad", bad);
  box.hidden = false;
}

// --- the page ------------------------------------------------------------------------------------

function showError(text) {
  const box = document.getElementById("error");
  box.hidden = !text;
  setText(box, text || "");
}

function update(state) {
  const stale = Boolean(state.error);
  const main = document.getElementById("prefixes");
  toggle(main, "stale", stale);
  if (stale) {
    const when = state.sampled_ms ? `the figures below are from ${fullTime(state.sampled_ms)}` : "nothing was read yet";
    showError(`${state.error.replace(/\.+$/, "")}; ${when}.`);
  } else {
    showError(null);
  }
  const empty = document.getElementById("no-prefix");
  empty.hidden = stale || state.prefixes.length > 0;
  syncChildren(main, state.prefixes, p => p.prefix, prefixSection, (section, p) => updatePrefix(section, p, stale));
  updateShelf(state.shelf);
}

async function refresh() {
  let state;
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    state = await response.json();
  } catch (err) {
    showError(`The dashboard server does not answer (${err}): the figures below are from before.`);
    toggle(document.getElementById("prefixes"), "stale", true);
    return;
  }
  session.interval = 1000 * state.interval;
  update(state);
  setText(document.getElementById("updated"), `updated ${new Date().toLocaleTimeString()}`);
}

async function loop() {
  await refresh();
  setTimeout(loop, session.interval);
}

async function start() {
  const info = await (await fetch("/api/session")).json();
  session.csrf = info.csrf;
  session.allowActions = info.allow_actions;
  setText(document.getElementById("mode"), info.allow_actions ? "actions allowed" : "read-only");
  document.getElementById("notice").addEventListener("click", event => { event.currentTarget.hidden = true; });
  loop();
}

start();

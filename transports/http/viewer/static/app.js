// The replay viewer: a live, filterable sessions list, and a session page that streams a live
// session (SSE + JSON Patch+) or replays a finished one from its log with a scrubber.
// Routes: #/?q=&status=&from=&to=  (the list and its filters)
//         #/s/ID?at=POS&find=TEXT&view=tokens  (a session, optionally at log position POS, with a
//           search; a chat session shows its conversation, or with view=tokens its token history)
// Forks and re-runs go through the same HTTP API as every other client.
import { applyPatch } from "/static/patch.js";
import { chatView } from "/static/chat.js";
import { h, morph } from "/static/dom.js";

const app = document.getElementById("app");
const conn = document.getElementById("conn");
const params = new URLSearchParams(location.search);
const token = params.get("token") || localStorage.getItem("sessiontape-token") || "";
if (params.get("token")) localStorage.setItem("sessiontape-token", token);

let cleanup = () => {};

function url(path) {
  if (!token) return path;
  return path + (path.includes("?") ? "&" : "?") + "access_token=" + encodeURIComponent(token);
}

// JSON.parse, but an integer beyond what a Number holds exactly (a seed up to 2**64 - 1) stays its
// digits, as a string: shown as sent, and sent back (the API takes a seed as digits) unrounded.
function parseJSON(text) {
  return JSON.parse(text, (_, v, ctx) =>
    (typeof v === "number" && !Number.isSafeInteger(v) && ctx?.source && /^-?[0-9]+$/.test(ctx.source) ? ctx.source : v));
}

async function getJSON(path) {
  const r = await fetch(url(path));
  const body = parseJSON(await r.text());
  if (!r.ok) throw new Error(`${body.error?.code}: ${body.error?.message}`);
  return body;
}

async function postJSON(path, body) {
  const headers = { "content-type": "application/json" };
  if (token) headers.authorization = `Bearer ${token}`;
  const r = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  const out = await r.json();
  if (!r.ok) throw new Error(`${out.error?.code}: ${out.error?.message}`);
  return out;
}

const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleString() : "");
// The list's compact local time: 2026-11-23 06:40 (a line break may fall only between date and time).
const fmtShort = (t) => {
  if (!t) return "";
  const d = new Date(t * 1000);
  const p = (x) => String(x).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}`;
};
const fmtNum = (x, d = 3) => (x == null ? "?" : Number(x).toFixed(d));

// The hash route: a path and its query.
function hashRoute() {
  const raw = location.hash.slice(1) || "/";
  const i = raw.indexOf("?");
  return { path: i < 0 ? raw : raw.slice(0, i), query: new URLSearchParams(i < 0 ? "" : raw.slice(i + 1)) };
}

// Rewrite the hash's query without a new history entry or a re-route.
function setQuery(path, values) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(values)) if (v !== "" && v != null) q.set(k, v);
  const s = q.toString();
  history.replaceState(null, "", `#${path}${s ? "?" + s : ""}`);
}

function notice(text, isError = false) {
  let el = document.getElementById("notice");
  if (!el) { el = h("div", { id: "notice", role: "status" }); document.body.append(el); }
  el.className = isError ? "error" : "";
  el.textContent = text;
  clearTimeout(notice.timer);
  notice.timer = setTimeout(() => el.remove(), isError ? 8000 : 3000);
}

// A patch stream: snapshot, then patches; EventSource resumes with Last-Event-ID by itself.
// onPatch(ops, doc) sees each patch once it is applied.
function stream(path, onDoc, onEnd, onPatch) {
  let doc = null;
  const es = new EventSource(url(path));
  es.addEventListener("snapshot", (e) => { doc = parseJSON(e.data); onDoc(doc); });
  es.addEventListener("patch", (e) => {
    const ops = parseJSON(e.data);
    doc = applyPatch(doc, ops, true);
    onPatch?.(ops, doc);
    onDoc(doc);
  });
  es.addEventListener("end", () => { es.close(); conn.textContent = "ended"; onEnd?.(doc); });
  es.onopen = () => { conn.textContent = "live"; };
  es.onerror = () => { conn.textContent = es.readyState === EventSource.CLOSED ? "closed" : "reconnecting…"; };
  return () => es.close();
}

// -- the sessions list ---------------------------------------------------------

const STATUSES = ["open", "closed", "aborted", "expired", "purged"];

function dayStart(s) { return s ? new Date(s + "T00:00:00").getTime() / 1000 : null; }

// what a session is about: its label, and the first user message (or input) it holds
function aboutCell(s) {
  return [s.label ? h("span", { class: "label" }, s.label) : null, s.label && s.preview ? " " : null,
    s.preview ? h("span", { class: "preview", title: s.preview }, s.preview) : null];
}

function listPage(query) {
  const q = h("input", { id: "filter-q", type: "search", placeholder: "search id, label or text", value: query.get("q") || "", "aria-label": "search id, label or text" });
  const status = h("select", { id: "filter-status", "aria-label": "status" }, h("option", { value: "" }, "any status"),
    STATUSES.map((s) => h("option", { value: s, selected: query.get("status") === s }, s)));
  const from = h("input", { id: "filter-from", type: "date", value: query.get("from") || "", "aria-label": "created from" });
  const to = h("input", { id: "filter-to", type: "date", value: query.get("to") || "", "aria-label": "created until" });
  const count = h("span", { class: "meta", id: "filter-count" });
  const tbody = h("tbody", { id: "sessions" });
  const cols = [["id", "col-id"], ["status", "col-status"], ["protocol", "col-protocol"], ["about", "col-label"], ["parent", "col-parent"], ["created", "col-created"]];
  app.replaceChildren(h("h2", {}, "Sessions"),
    h("div", { class: "filters" }, q, status, h("label", { class: "date" }, "from ", from), h("label", { class: "date" }, "to ", to), count),
    h("table", { class: "runs" }, h("thead", {}, h("tr", {}, cols.map(([c, cls]) => h("th", { class: cls }, c)))), tbody));
  let last = null;
  const render = (doc) => {
    if (doc) last = doc;
    if (!last) return;
    const needle = q.value.trim().toLowerCase();
    const lo = dayStart(from.value);
    const hi = to.value ? dayStart(to.value) + 86400 : null;
    const all = Object.values(last.sessions).sort((a, b) => b.created_at - a.created_at);
    const rows = all.filter((s) => (!needle || [s.id, s.label, s.preview].some((v) => (v || "").toLowerCase().includes(needle)))
      && (!status.value || s.status === status.value)
      && (lo == null || s.created_at >= lo) && (hi == null || s.created_at < hi));
    count.textContent = rows.length === all.length ? `${all.length} sessions` : `${rows.length} of ${all.length} sessions`;
    morph(tbody, rows.map((s) => h("tr", {
      class: `session-row status-${s.status}${s.generating ? " generating" : ""}`, "data-id": s.id,
      onclick: () => { location.hash = `#/s/${s.id}`; },
    }, h("td", { class: "col-id" }, h("a", { href: `#/s/${s.id}` }, s.id)), h("td", { class: "status col-status" }, s.status),
      h("td", { class: "col-protocol" }, s.protocol), h("td", { class: "col-label" }, aboutCell(s)),
      h("td", { class: "col-parent" }, s.parent_id || ""), h("td", { class: "col-created", title: fmtTime(s.created_at) }, fmtShort(s.created_at)))));
  };
  const changed = () => {
    setQuery("/", { q: q.value.trim(), status: status.value, from: from.value, to: to.value });
    render();
  };
  for (const el of [q, status, from, to]) el.addEventListener("input", changed);
  return stream("/v1/sessions/events", render);
}

// -- rendering a session document ----------------------------------------------------

function tokenSpan(t, g) {
  const top = (t.top || []).map((a) => `${JSON.stringify(a.text)} (${a.id}) ${a.logprob.toFixed(3)}`).join(", ");
  const title = `id ${t.id} · pos ${t.position}` + (t.logprob != null ? ` · logprob ${t.logprob.toFixed(3)}` : "") + (top ? ` · top: ${top}` : "");
  return h("span", { class: "tok" + (t.logprob != null && t.logprob < -4 ? " low" : ""), title, "data-id": t.id,
    "data-pos": t.position, "data-gen": g.id, tabindex: "0" }, t.text ?? `[${t.id}]`);
}

const PARAM_ORDER = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"];

function paramText(g) {
  const p = g.params || {};
  const keys = [...PARAM_ORDER.filter((k) => k in p), ...Object.keys(p).filter((k) => !PARAM_ORDER.includes(k))];
  const parts = keys.filter((k) => p[k] != null && !(Array.isArray(p[k]) && !p[k].length)).map((k) => `${k} ${Array.isArray(p[k]) ? p[k].join(",") : p[k]}`);
  const o = g.options || {};
  if (o.logprob_top_k) parts.push(`top-k logprobs ${o.logprob_top_k}`);
  return parts.join(" · ");
}

function genSummary(doc, g, actions) {
  const t = g.timing;
  const head = g.status === "finished"
    ? [h("span", { class: `finish ${g.finish_reason}` }, g.finish_reason || "finished"),
      t ? ` · ${t.completion_tokens} tokens in ${fmtNum(t.total_s)} s` + (t.ttft_s != null ? ` (first token ${fmtNum(t.ttft_s)} s)` : "") : ""]
    : [h("span", { class: "finish running" }, "generating…"), ` · ${g.tokens.length} tokens so far`];
  const act = g.action_id ? actions.find((a) => a.id === g.action_id) : null;
  return h("div", { class: "gen-summary", "data-gen": g.id },
    h("div", { class: "gen-head" }, h("span", { class: "gen-id" }, g.id), " ", ...head),
    h("div", { class: "gen-params" }, paramText(g)),
    act ? h("div", { class: "gen-action" }, `action ${act.id} · ${act.name} · ${act.status}`) : null,
    g.status === "finished" ? h("div", { class: "gen-buttons" },
      h("button", { class: "rerun", "data-gen": g.id, title: "fork before this generation and run it again with the same parameters", onclick: () => rerun(doc, g, g.prompt_length) }, "re-run"),
      h("button", { class: "fork-after", "data-gen": g.id, title: "fork the session after this generation", onclick: () => forkAt(doc.id, { at_position: g.prompt_length + g.tokens.length }) }, "fork after")) : null);
}

function kv(obj) {
  return Object.entries(obj).filter(([k]) => !["at", "version"].includes(k))
    .map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`).join(" · ");
}

function feedbackItem(f) {
  return h("div", { class: "fb", "data-version": f.version }, h("span", { class: "tag" }, "feedback"), " ", kv(f));
}

function errorItem(e) {
  return h("div", { class: "err", "data-version": e.version }, h("span", { class: "tag" }, `error ${e.code || ""}`), " ", e.message || kv(e));
}

const ROLE = { input: "input", generation: "model", inherited: "inherited", truncated: "truncated" };

function conversation(doc) {
  const hist = doc.history;
  const gens = Object.fromEntries(doc.generations.map((g) => [g.id, g]));
  const actions = Array.isArray(doc.actions) ? doc.actions : Object.values(doc.actions || {});
  const segs = hist.segments;
  // Feedback and errors go after the last generation that started before them (they are about it).
  const byTime = [...doc.generations].sort((a, b) => a.started_at - b.started_at);
  const after = new Map();
  const before = [];
  for (const item of [...doc.feedback.map((f) => feedbackItem(f)), ...doc.errors.map((e) => errorItem(e))]
    .map((el, i) => ({ el, at: i < doc.feedback.length ? doc.feedback[i].at : doc.errors[i - doc.feedback.length].at }))
    .sort((a, b) => a.at - b.at)) {
    const g = byTime.filter((x) => x.started_at <= item.at).pop();
    if (!g) before.push(item.el);
    else { if (!after.has(g.id)) after.set(g.id, []); after.get(g.id).push(item.el); }
  }
  const lastSegOf = {};
  segs.forEach((seg, i) => { if (seg.generation_id) lastSegOf[seg.generation_id] = i; });
  const out = [];
  let prevRole = null;
  const placed = new Set();
  segs.forEach((seg, i) => {
    const end = i + 1 < segs.length ? segs[i + 1].start : hist.ids.length;
    const role = ROLE[seg.source] || seg.source;
    const el = h("div", { class: `seg ${seg.source}`, "data-start": seg.start });
    if (role !== prevRole) el.append(h("span", { class: "who" }, role));
    prevRole = role;
    const body = h("span", { class: "seg-text" });
    if (seg.source === "generation" && gens[seg.generation_id]) {
      const g = gens[seg.generation_id];
      body.append(...g.tokens.filter((t) => t.position >= seg.start && t.position < end).map((t) => tokenSpan(t, g)));
    } else {
      body.append(seg.text ?? hist.ids.slice(seg.start, end).join(" "));
    }
    el.append(body);
    for (const im of hist.images.filter((im) => im.start >= seg.start && im.start < end)) {
      el.append(h("img", { class: "inline", src: url(`/v1/sessions/${doc.id}/images/${im.sha256}`), alt: im.mime }));
    }
    out.push(el);
    if (i === 0) out.push(...before);
    const g = seg.generation_id && gens[seg.generation_id];
    if (g && lastSegOf[g.id] === i) {
      out.push(genSummary(doc, g, actions));
      placed.add(g.id);
      out.push(...(after.get(g.id) || []));
      prevRole = null;
    }
  });
  if (!segs.length) out.push(...before);
  // generations with no tokens in the history (nothing generated yet, or all dropped)
  for (const g of doc.generations) {
    if (!placed.has(g.id)) { out.push(genSummary(doc, g, actions)); out.push(...(after.get(g.id) || [])); }
  }
  return out;
}

// node id -> the session's own event versions that touched it, ascending: from the /replay steps'
// patches, then from each live patch (noteNodes). A fork's inherited nodes are there from its first version.
function nodeVersions(rep) {
  const out = new Map();
  for (const id of Object.keys(rep.base?.nodes || {})) out.set(id, [1]);
  for (const st of rep.steps) {
    if (st.version != null && st.session_id === rep.session_id) noteNodes(out, st.patch, st.version);
  }
  return out;
}

function noteNodes(versions, ops, version) {
  for (const op of ops) {
    const parts = (op.path || "").split("/");
    if (parts[1] !== "nodes" || !parts[2]) continue;
    const id = parts[2].replace(/~1/g, "/").replace(/~0/g, "~");
    const seen = versions.get(id) || [];
    if (seen[seen.length - 1] !== version) seen.push(version);
    versions.set(id, seen);
  }
}

// The version to fork at so that node `id` is as `doc` shows it: the last version up to the document's
// that touched it (a scrubbed-back document shows an earlier state); failing that, the document's own.
function nodeVersion(versions, id, doc) {
  const seen = versions?.get(id) || [];
  for (let i = seen.length - 1; i >= 0; i--) if (seen[i] <= doc.version) return seen[i];
  return doc.version > 0 ? doc.version : null;
}

function nodeTree(doc, id, seen = new Set(), versions = null) {
  const n = doc.nodes[id];
  if (!n || seen.has(id)) return h("li", {}, h("span", { class: "node-id" }, `${id} (missing)`));
  seen.add(id);
  const label = h("span", { class: "node-id" }, `${id} · ${n.kind}${n.mimetype ? " · " + n.mimetype : ""}${n.role ? " · " + n.role : ""}${n.complete ? "" : " · incomplete"}`);
  const v = nodeVersion(versions, id, doc);
  const fork = v ? h("button", { class: "fork-node", "data-node": id, title: `fork the session once this node is as shown (event v${v})`,
    onclick: () => forkAt(doc.id, { at_version: v }) }, "fork after") : null;
  const body = [];
  if (n.kind === "leaf") {
    if (n.text != null) body.push(h("div", { class: "node-text" }, n.text));
    else if ((n.mimetype || "").startsWith("image/")) body.push(h("img", { class: "inline", src: n.ref || url(`/v1/sessions/${doc.id}/nodes/${id}/content`) }));
    else body.push(h("div", { class: "meta" }, n.ref ? n.ref : `${n.size} bytes`));
  }
  const kids = n.children.length ? h("ul", { class: "nodes" }, n.children.map((c) => nodeTree(doc, c, seen, versions))) : null;
  return h("li", { "data-node": id }, label, fork ? " " : null, fork, ...body, kids);
}

function actionsList(doc) {
  const actions = Array.isArray(doc.actions) ? doc.actions : Object.values(doc.actions || {});
  if (!actions.length) return [];
  const io = (m) => (Array.isArray(m) ? m.map((x) => `${x.name}=${x.id}`) : Object.entries(m || {}).map(([k, v]) => `${k}=${v}`)).join(", ");
  return [h("h3", {}, "Actions"), h("ul", { class: "actions", id: "actions" }, actions.map((a) => h("li", { class: `action ${a.status}`, "data-action": a.id },
    h("span", { class: "tag" }, a.name), ` ${a.id} · ${a.status}${a.direction === "out" ? " · sent to the client (a tool call)" : ""}`,
    h("div", { class: "meta" }, `inputs ${io(a.inputs) || "none"} → outputs ${io(a.outputs) || "none"}`),
    a.error ? h("div", { class: "err" }, typeof a.error === "object" ? `${a.error.code || ""} ${a.error.message || ""}` : String(a.error)) : null)))];
}

function header(doc) {
  const a = doc.audit;
  return [
    h("h2", {}, doc.label ? h("span", { class: "label" }, doc.label) : null, " ", h("small", { class: "node-id sid" }, doc.id), " ", h("span", { class: `badge ${doc.status}`, id: "status" }, doc.status)),
    h("div", { class: "meta" }, `${doc.protocol} · ${doc.engine.engine || "?"} ${doc.engine.model_id || ""} on ${doc.engine.provider || "?"} · v${doc.version} · ${doc.history.ids.length} tokens · created ${fmtTime(doc.created_at)}`),
    h("div", { class: `meta audit ${a.chain}`, id: "audit" }, `hash chain ${a.chain}` + (a.error ? `: ${a.error}` : "") + ` · head ${a.head_hash.slice(0, 12)}…`),
    h("div", { class: "meta forks", id: "forks" },
      doc.parent ? ["forked from ", h("a", { href: `#/s/${doc.parent.session_id}` }, doc.parent.session_id), ` at v${doc.parent.version}` + (doc.parent.token_position != null ? ` token ${doc.parent.token_position}` : ""), " · "] : null,
      doc.children.length ? ["forks: ", ...doc.children.map((c) => h("a", { href: `#/s/${c.session_id}` }, `${c.session_id} (${c.token_position ?? "v" + c.version})`))] : "no forks"),
  ];
}

// -- forks and re-runs, through the HTTP API ---------------------------------------------

async function forkAt(sid, where) {
  try {
    const child = await postJSON(`/v1/sessions/${sid}/fork`, where);
    notice(`forked ${child.id}`);
    location.hash = `#/s/${child.id}`;
    return child;
  } catch (err) { notice(`fork failed: ${err.message}`, true); return null; }
}

const NO_PENALTY = { repetition_penalty: 1, frequency_penalty: 0, presence_penalty: 0, min_p: 0 };

// Fork at `position` (inside or at the start of generation g) and generate again with g's parameters.
async function rerun(doc, g, position) {
  const child = await forkAt(doc.id, { at_position: position });
  if (!child) return;
  const p = g.params || {};
  const body = { background: true, logprob_top_k: g.options?.logprob_top_k || 0 };
  for (const k of ["temperature", "top_p", "top_k", "seed", "stop_token_ids", "penalty_last_n"]) if (p[k] != null) body[k] = p[k];
  // recorded only where they act: absent means none (not the model's recommendation)
  for (const [k, none] of Object.entries(NO_PENALTY)) body[k] = p[k] ?? none;
  const done = position - g.prompt_length;
  if (p.max_tokens != null) body.max_tokens = Math.max(1, p.max_tokens - Math.max(0, done));
  try { await postJSON(`/v1/sessions/${child.id}/generate`, body); }
  catch (err) { notice(`re-run failed: ${err.message}`, true); }
}

// The token menu: what a click on a generated token offers.
function tokenMenu(doc, span) {
  document.getElementById("tokmenu")?.remove();
  const g = doc.generations.find((x) => x.id === span.dataset.gen);
  const pos = Number(span.dataset.pos);
  const t = g?.tokens.find((x) => x.position === pos);
  if (!g || !t) return;
  const close = () => menu.remove();
  const menu = h("div", { id: "tokmenu", role: "dialog" },
    h("div", { class: "tok-detail" }, `token ${JSON.stringify(t.text)} · id ${t.id} · position ${pos}` + (t.logprob != null ? ` · logprob ${t.logprob.toFixed(3)}` : "")),
    t.top?.length ? h("div", { class: "meta" }, "alternatives: " + t.top.map((a) => `${JSON.stringify(a.text)} ${a.logprob.toFixed(2)}`).join(", ")) : null,
    h("div", { class: "gen-buttons" },
      h("button", { id: "fork-token", onclick: () => { close(); forkAt(doc.id, { at_position: pos }); } }, "fork before this token"),
      h("button", { id: "rerun-token", onclick: () => { close(); rerun(doc, g, pos); } }, "re-run from here"),
      h("button", { class: "close", onclick: close }, "close")));
  document.body.append(menu);
}

// -- search within a session ---------------------------------------------------------------

// Mark the matches of `needle` in `root`: text in plain elements gets <mark>, token spans get .hit.
function highlight(root, needle) {
  const hits = [];
  if (!needle) return hits;
  const lower = needle.toLowerCase();
  for (const el of root.querySelectorAll(".seg-text, .bubble-text, .gen-summary, .fb, .err")) {
    const toks = [...el.querySelectorAll(".tok")];
    if (toks.length) {
      let text = "";
      const starts = toks.map((s) => { const at = text.length; text += s.textContent; return at; });
      const hay = text.toLowerCase();
      for (let i = hay.indexOf(lower); i >= 0; i = hay.indexOf(lower, i + 1)) {
        const first = toks.findIndex((s, k) => starts[k] + s.textContent.length > i);
        for (let k = first; k < toks.length && starts[k] < i + lower.length; k++) toks[k].classList.add("hit");
        hits.push(toks[first]);
      }
      continue;
    }
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    const nodes = [];
    while (walker.nextNode()) nodes.push(walker.currentNode);
    for (const node of nodes) {
      const s = node.nodeValue;
      const hay = s.toLowerCase();
      if (!hay.includes(lower)) continue;
      const frag = document.createDocumentFragment();
      let at = 0;
      for (let i = hay.indexOf(lower); i >= 0; i = hay.indexOf(lower, i + lower.length)) {
        frag.append(s.slice(at, i));
        const m = h("mark", {}, s.slice(i, i + lower.length));
        frag.append(m);
        hits.push(m);
        at = i + lower.length;
      }
      frag.append(s.slice(at));
      node.replaceWith(frag);
    }
  }
  return hits;
}

// -- the session page ----------------------------------------------------------------

function sessionPage(id, query) {
  const head = h("div", { id: "head" });
  const controls = h("div", { class: "controls", id: "controls" });
  const find = h("input", { id: "find", type: "search", placeholder: "find in session", value: query.get("find") || "", "aria-label": "find in session" });
  const findCount = h("span", { class: "meta", id: "find-count" });
  const findNext = h("button", { id: "find-next", title: "next match" }, "next");
  const convo = h("div", { id: "conversation" });
  const nodes = h("div", { id: "nodes" });
  const follow = h("span", { class: "follow", id: "follow" }, "following");
  // A chat session (its document has a conversation) shows chat bubbles; the toggle shows its tokens.
  const toggle = h("button", { id: "view-toggle", hidden: true });
  app.replaceChildren(head, controls, h("div", { class: "controls find" }, find, findNext, findCount, toggle, follow), convo, nodes);

  let at = query.get("at");  // a log position from the URL, or null
  let view = query.get("view") === "tokens" ? "tokens" : "chat";
  const syncUrl = () => setQuery(`/s/${id}`, { at, find: find.value.trim(), view: view === "tokens" ? view : "" });
  toggle.addEventListener("click", () => { view = view === "chat" ? "tokens" : "chat"; syncUrl(); if (current) draw(current); applyFind(false); });

  // Follow is sticky to the bottom; scrolling up detaches it, returning to the bottom re-attaches.
  let following = true;
  convo.addEventListener("scroll", () => {
    const atBottom = convo.scrollHeight - convo.scrollTop - convo.clientHeight < 24;
    following = atBottom;
    follow.textContent = following ? "following" : "detached — click to follow";
    follow.className = "follow" + (following ? "" : " detached");
  });
  follow.addEventListener("click", () => { following = true; convo.scrollTop = convo.scrollHeight; follow.textContent = "following"; follow.className = "follow"; });

  let current = null;
  let versions = null;
  let hits = [];
  let hitAt = -1;
  const applyFind = (scroll) => {
    hits = highlight(convo, find.value.trim());
    const needle = find.value.trim();
    findCount.textContent = needle ? `${hits.length} match${hits.length === 1 ? "" : "es"}` : "";
    if (scroll && hits.length) { hitAt = 0; show(); }
  };
  const show = () => {
    hits.forEach((m, i) => m.classList.toggle("current", i === hitAt));
    following = false;
    hits[hitAt]?.scrollIntoView({ block: "center" });
  };
  find.addEventListener("input", () => { syncUrl(); if (current) draw(current); applyFind(true); });
  find.addEventListener("keydown", (e) => { if (e.key === "Enter") findNext.click(); });
  findNext.addEventListener("click", () => { if (!hits.length) return; hitAt = (hitAt + 1) % hits.length; show(); });
  convo.addEventListener("click", (e) => {
    const span = e.target.closest?.(".tok");
    if (span && current) tokenMenu(current, span);
  });

  const draw = (d) => {
    morph(head, header(d).flat());
    const chat = view === "chat" && d.conversation?.length > 0;
    toggle.hidden = !d.conversation?.length;
    toggle.textContent = chat ? "show tokens" : "show chat";
    convo.classList.toggle("chat", chat);
    const actions = Array.isArray(d.actions) ? d.actions : Object.values(d.actions || {});
    morph(convo, chat ? chatView(d, (g) => genSummary(d, g, actions), (pos) => forkAt(d.id, { at_position: pos })) : conversation(d));
    morph(nodes, [...(d.roots.length ? [h("h3", {}, "Nodes"), h("ul", { class: "nodes" }, d.roots.map((r) => nodeTree(d, r, new Set(), versions)))] : []), ...actionsList(d)]);
  };
  let pending = null;
  const render = (doc) => {
    pending = doc;
    requestAnimationFrame(() => {
      if (!pending) return;
      const d = pending; pending = null;
      current = d;
      draw(d);
      applyFind(false);
      if (following) convo.scrollTop = convo.scrollHeight;
    });
  };

  let stop = () => {};
  let disposed = false;
  getJSON(`/v1/sessions/${id}/replay`).then((rep) => {
    if (disposed) return;
    versions = nodeVersions(rep);
    const live = rep.steps.length && ["open"].includes(docAt(rep, rep.steps.length).status);
    if (live && at == null) {
      controls.replaceChildren(h("span", { class: "meta", id: "mode" }, "live"));
      stop = stream(`/v1/sessions/${id}/events`, render, (doc) => { if (doc) render(doc); },
        (ops, doc) => noteNodes(versions, ops, doc.version));
    } else {
      stop = scrubber(rep, controls, render, id, at, (pos) => { at = pos; syncUrl(); });
    }
    if (find.value.trim()) requestAnimationFrame(() => requestAnimationFrame(() => applyFind(true)));
  }).catch((err) => { app.append(h("p", { class: "error" }, String(err))); });
  return () => { disposed = true; stop(); document.getElementById("tokmenu")?.remove(); };
}

// The document after the first n steps. Checkpoints every 256 steps make jumps cheap.
const checkpoints = new WeakMap();
function docAt(rep, n) {
  let cps = checkpoints.get(rep);
  if (!cps) { cps = [rep.base]; checkpoints.set(rep, cps); }
  const k = Math.min(Math.floor(n / 256), cps.length - 1);
  let doc = structuredClone(cps[k]);
  for (let i = k * 256; i < n; i++) {
    doc = applyPatch(doc, rep.steps[i].patch, true);
    if ((i + 1) % 256 === 0 && cps.length === (i + 1) / 256) cps.push(structuredClone(doc));
  }
  return doc;
}

function scrubber(rep, controls, render, sid, startPos, onMove) {
  const n = rep.steps.length;
  // ?at=POS opens the session as it was once the event at log position POS was committed.
  let at = n;
  if (startPos != null && startPos !== "") {
    const pos = Number(startPos);
    at = rep.steps.filter((s) => s.position <= pos).length;
  }
  let timer = null;
  let speed = 1;
  const range = h("input", { type: "range", min: 0, max: n, value: at, id: "scrub", "aria-label": "log position" });
  const label = h("span", { class: "meta", id: "step" });
  const play = h("button", { id: "play" }, "▶ play");
  const speedSel = h("select", { id: "speed", "aria-label": "speed" }, [0.5, 1, 2, 4, 16, 64].map((s) => h("option", { value: s, selected: s === 1 }, `${s}×`)));
  // Fork the session as it is at this step (by event version): the fork shows up in every client.
  const fork = h("button", { id: "fork-here", title: "fork the session as it is at this point of the log" }, "fork here");
  const show = () => {
    range.value = at;
    const st = rep.steps[at - 1];
    label.textContent = `event ${at}/${n}` + (st ? ` · ${st.type} · position ${st.position} · ${fmtTime(st.recorded_at)}` : "");
    fork.disabled = !(ownVersion(rep, at) > 0);
    render(docAt(rep, at));
  };
  const pause = () => { clearTimeout(timer); timer = null; play.textContent = "▶ play"; };
  // Original timing: wait the recorded gap between consecutive events, scaled by speed.
  const tick = () => {
    if (at >= n) { pause(); return; }
    at += 1; show();
    const gap = at < n ? (rep.steps[at].recorded_at - rep.steps[at - 1].recorded_at) : 0;
    timer = setTimeout(tick, Math.min(2000, Math.max(0, gap * 1000 / speed)));
  };
  play.addEventListener("click", () => {
    if (timer) { pause(); return; }
    if (at >= n) at = 0;
    play.textContent = "⏸ pause";
    show();
    timer = setTimeout(tick, 0);
  });
  range.addEventListener("input", () => {
    pause(); at = Number(range.value); show();
    onMove(at >= n ? null : rep.steps[at - 1]?.position ?? 0);
  });
  speedSel.addEventListener("change", () => { speed = Number(speedSel.value); });
  fork.addEventListener("click", () => forkAt(sid, { at_version: ownVersion(rep, at) }));
  controls.replaceChildren(h("span", { class: "meta", id: "mode" }, "replay"), play, speedSel, range, fork, label);
  show();
  return pause;
}

// The session's own event version after the first n steps (steps of forks carry no version).
function ownVersion(rep, n) {
  for (let i = n - 1; i >= 0; i--) if (rep.steps[i].version != null) return rep.steps[i].version;
  return 0;
}

// -- routing ---------------------------------------------------------------------

function route() {
  cleanup();
  conn.textContent = "";
  const { path, query } = hashRoute();
  const m = path.match(/^\/s\/([^/?]+)/);
  cleanup = m ? sessionPage(decodeURIComponent(m[1]), query) : listPage(query);
}
window.addEventListener("hashchange", route);
route();

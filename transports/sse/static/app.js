// The replay viewer: a live sessions list, and a session page that streams a live
// session (SSE + JSON Patch+) or replays a finished one from its log with a scrubber.
import { applyPatch } from "/static/patch.js";

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

async function getJSON(path) {
  const r = await fetch(url(path));
  const body = await r.json();
  if (!r.ok) throw new Error(`${body.error?.code}: ${body.error?.message}`);
  return body;
}

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) el.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}

const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleString() : "");

// A patch stream: snapshot, then patches; EventSource resumes with Last-Event-ID by itself.
function stream(path, onDoc, onEnd) {
  let doc = null;
  const es = new EventSource(url(path));
  es.addEventListener("snapshot", (e) => { doc = JSON.parse(e.data); onDoc(doc); });
  es.addEventListener("patch", (e) => { doc = applyPatch(doc, JSON.parse(e.data), true); onDoc(doc); });
  es.addEventListener("end", () => { es.close(); conn.textContent = "ended"; onEnd?.(doc); });
  es.onopen = () => { conn.textContent = "live"; };
  es.onerror = () => { conn.textContent = es.readyState === EventSource.CLOSED ? "closed" : "reconnecting…"; };
  return () => es.close();
}

// -- the sessions list ---------------------------------------------------------

function listPage() {
  const tbody = h("tbody", { id: "sessions" });
  app.replaceChildren(h("h2", {}, "Recent sessions"),
    h("table", {}, h("thead", {}, h("tr", {}, ["id", "status", "protocol", "label", "parent", "created"].map((c) => h("th", {}, c)))), tbody));
  const render = (doc) => {
    const rows = Object.values(doc.sessions).sort((a, b) => b.created_at - a.created_at);
    tbody.replaceChildren(...rows.map((s) => h("tr", {
      class: `session-row status-${s.status}${s.generating ? " generating" : ""}`, "data-id": s.id,
      onclick: () => { location.hash = `#/s/${s.id}`; },
    }, h("td", {}, h("a", { href: `#/s/${s.id}` }, s.id)), h("td", { class: "status" }, s.status), h("td", {}, s.protocol),
      h("td", {}, s.label), h("td", {}, s.parent_id || ""), h("td", {}, fmtTime(s.created_at)))));
  };
  return stream("/v1/sessions/events", render);
}

// -- rendering a session document ----------------------------------------------------

function tokenSpan(t) {
  const top = (t.top || []).map((a) => `${JSON.stringify(a.text)} (${a.id}) ${a.logprob.toFixed(3)}`).join(", ");
  const title = `id ${t.id} · pos ${t.position}` + (t.logprob != null ? ` · logprob ${t.logprob.toFixed(3)}` : "") + (top ? ` · top: ${top}` : "");
  return h("span", { class: "tok" + (t.logprob != null && t.logprob < -4 ? " low" : ""), title, "data-id": t.id }, t.text ?? `[${t.id}]`);
}

function conversation(doc) {
  const hist = doc.history;
  const gens = Object.fromEntries(doc.generations.map((g) => [g.id, g]));
  const segs = hist.segments.length ? hist.segments : [];
  const out = [];
  segs.forEach((seg, i) => {
    const end = i + 1 < segs.length ? segs[i + 1].start : hist.ids.length;
    const el = h("div", { class: `seg ${seg.source}`, "data-start": seg.start });
    if (seg.source === "generation" && gens[seg.generation_id]) {
      const toks = gens[seg.generation_id].tokens.filter((t) => t.position >= seg.start && t.position < end);
      el.append(...toks.map(tokenSpan));
    } else {
      const ids = hist.ids.slice(seg.start, end);
      el.append(seg.text ?? ids.join(" "));
    }
    for (const im of hist.images.filter((im) => im.start >= seg.start && im.start < end)) {
      el.append(h("img", { class: "inline", src: url(`/v1/sessions/${doc.id}/images/${im.sha256}`), alt: im.mime }));
    }
    out.push(el);
  });
  for (const g of doc.generations) {
    if (g.status === "finished" && g.finish_reason) out.push(h("div", { class: "meta" }, `generation ${g.id}: ${g.finish_reason}` +
      (g.timing?.total_s != null ? ` · ${g.timing.completion_tokens} tokens in ${g.timing.total_s.toFixed(3)} s` : "")));
  }
  return out;
}

function nodeTree(doc, id, seen = new Set()) {
  const n = doc.nodes[id];
  if (!n || seen.has(id)) return h("li", {}, h("span", { class: "node-id" }, `${id} (missing)`));
  seen.add(id);
  const label = h("span", { class: "node-id" }, `${id} · ${n.kind}${n.mimetype ? " · " + n.mimetype : ""}${n.role ? " · " + n.role : ""}${n.complete ? "" : " · incomplete"}`);
  const body = [];
  if (n.kind === "leaf") {
    if (n.text != null) body.push(h("div", {}, n.text));
    else if (n.mimetype.startsWith("image/")) body.push(h("img", { class: "inline", src: n.ref || url(`/v1/sessions/${doc.id}/nodes/${id}/content`) }));
    else body.push(h("div", { class: "meta" }, n.ref ? n.ref : `${n.size} bytes`));
  }
  const kids = n.children.length ? h("ul", { class: "nodes" }, n.children.map((c) => nodeTree(doc, c, seen))) : null;
  return h("li", {}, label, ...body, kids);
}

function header(doc) {
  const a = doc.audit;
  return [
    h("h2", {}, doc.label ? `${doc.label} ` : "", h("small", { class: "node-id" }, doc.id), " ", h("span", { class: `badge ${doc.status}`, id: "status" }, doc.status)),
    h("div", { class: "meta" }, `${doc.protocol} · ${doc.engine.engine || "?"} ${doc.engine.model_id || ""} on ${doc.engine.provider || "?"} · v${doc.version} · ${doc.history.ids.length} tokens · created ${fmtTime(doc.created_at)}`),
    h("div", { class: `meta audit ${a.chain}`, id: "audit" }, `hash chain ${a.chain}` + (a.error ? `: ${a.error}` : "") + ` · head ${a.head_hash.slice(0, 12)}…`),
    h("div", { class: "meta forks", id: "forks" },
      doc.parent ? ["forked from ", h("a", { href: `#/s/${doc.parent.session_id}` }, doc.parent.session_id), ` at v${doc.parent.version}` + (doc.parent.token_position != null ? ` token ${doc.parent.token_position}` : ""), " · "] : null,
      doc.children.length ? ["forks: ", ...doc.children.map((c) => h("a", { href: `#/s/${c.session_id}` }, `${c.session_id} (${c.token_position ?? "v" + c.version})`))] : "no forks"),
  ];
}

// -- the session page ----------------------------------------------------------------

function sessionPage(id) {
  const head = h("div", { id: "head" });
  const controls = h("div", { class: "controls", id: "controls" });
  const convo = h("div", { id: "conversation" });
  const nodes = h("div", { id: "nodes" });
  const follow = h("span", { class: "follow", id: "follow" }, "following");
  app.replaceChildren(head, controls, follow, convo, nodes);

  // Follow is sticky to the bottom; scrolling up detaches it, returning to the bottom re-attaches.
  let following = true;
  convo.addEventListener("scroll", () => {
    const atBottom = convo.scrollHeight - convo.scrollTop - convo.clientHeight < 24;
    following = atBottom;
    follow.textContent = following ? "following" : "detached — click to follow";
    follow.className = "follow" + (following ? "" : " detached");
  });
  follow.addEventListener("click", () => { following = true; convo.scrollTop = convo.scrollHeight; follow.textContent = "following"; follow.className = "follow"; });

  let pending = null;
  const render = (doc) => {
    pending = doc;
    requestAnimationFrame(() => {
      if (!pending) return;
      const d = pending; pending = null;
      head.replaceChildren(...header(d));
      convo.replaceChildren(...conversation(d));
      nodes.replaceChildren(...(d.roots.length ? [h("h3", {}, "Nodes"), h("ul", { class: "nodes" }, d.roots.map((r) => nodeTree(d, r)))] : []));
      if (following) convo.scrollTop = convo.scrollHeight;
    });
  };

  let stop = () => {};
  let disposed = false;
  getJSON(`/v1/sessions/${id}/replay`).then((rep) => {
    if (disposed) return;
    const live = rep.steps.length && ["open"].includes(docAt(rep, rep.steps.length).status);
    if (live) {
      controls.replaceChildren(h("span", { class: "meta", id: "mode" }, "live"));
      stop = stream(`/v1/sessions/${id}/events`, render, (doc) => { if (doc) render(doc); });
    } else {
      stop = scrubber(rep, controls, render);
    }
  }).catch((err) => { app.append(h("p", { class: "error" }, String(err))); });
  return () => { disposed = true; stop(); };
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

function scrubber(rep, controls, render) {
  const n = rep.steps.length;
  let at = n;
  let timer = null;
  let speed = 1;
  const range = h("input", { type: "range", min: 0, max: n, value: n, id: "scrub" });
  const label = h("span", { class: "meta", id: "step" });
  const play = h("button", { id: "play" }, "▶ play");
  const speedSel = h("select", { id: "speed" }, [0.5, 1, 2, 4, 16, 64].map((s) => h("option", { value: s, ...(s === 1 ? { selected: "" } : {}) }, `${s}×`)));
  const show = () => {
    range.value = at;
    const st = rep.steps[at - 1];
    label.textContent = `event ${at}/${n}` + (st ? ` · ${st.type} · ${fmtTime(st.recorded_at)}` : "");
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
  range.addEventListener("input", () => { pause(); at = Number(range.value); show(); });
  speedSel.addEventListener("change", () => { speed = Number(speedSel.value); });
  controls.replaceChildren(h("span", { class: "meta", id: "mode" }, "replay"), play, speedSel, range, label);
  show();
  return pause;
}

// -- routing ---------------------------------------------------------------------

function route() {
  cleanup();
  conn.textContent = "";
  const m = location.hash.match(/^#\/s\/([^/?]+)/);
  cleanup = m ? sessionPage(decodeURIComponent(m[1])) : listPage();
}
window.addEventListener("hashchange", route);
route();

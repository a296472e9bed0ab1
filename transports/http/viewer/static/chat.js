// The chat view of a session the OpenAI routes drove: its document's `conversation` (one turn per
// message, in the order the chat template placed them, then each reply) as bubbles by role. The
// turns are the document's, so a live session's reply grows as its tokens arrive, and a scrubbed-back
// document shows the conversation as it was then (later turns absent, a reply cut to what existed).
import { h } from "/static/dom.js";

function bubble(cls, attrs, label, text) {
  return h("div", { class: `bubble ${cls}`, ...attrs }, h("span", { class: "who" }, label), h("div", { class: "bubble-text" }, text));
}

function pretty(json) {
  try { return JSON.stringify(JSON.parse(json), null, 2); } catch { return json ?? ""; }
}

// the calls the reader collapsed: a live session redraws on every event, and they stay collapsed
const collapsed = new Set();

// A tool call (a `tool_call` turn) as a collapsible bubble: the function and its call id, the
// arguments beneath, and the result the `tool` turn answering it brought, when there is one.
function toolCall(t, i, result, forkAfter) {
  const c = t.call || {};
  const who = c.supplied_by === "client" ? "tool call · sent by the client" : "tool call";
  const ontoggle = (ev) => { if (ev.target.open) collapsed.delete(c.id); else collapsed.add(c.id); };
  return h("details", { class: `bubble tool_call${t.inherited ? " inherited" : ""}`,
    open: collapsed.has(c.id) ? null : "", ontoggle, "data-turn": i,
    "data-role": "tool_call", "data-call": c.id, "data-gen": t.generation_id, "data-start": t.start, "data-end": t.end,
    title: `tokens ${t.start}–${t.end}` },
  h("summary", {}, h("span", { class: "who" }, who), h("code", { class: "call-name" }, `${c.name}()`), " ",
    h("span", { class: "call-id" }, c.id ?? "")),
  h("pre", { class: "call-arguments" }, pretty(c.arguments)),
  result ? h("div", { class: "tool-result", "data-turn": result.i }, h("span", { class: "who" }, "result"),
    h("pre", {}, result.turn.text ?? "")) : h("div", { class: "tool-result pending" }, "no result yet"),
  forkAfter ? h("button", { class: "fork-call", title: "fork the session right after this call (and its result)",
    onclick: () => forkAfter(result ? result.turn.end : t.end) }, "fork after") : null);
}

// The bubbles, each reply followed by its generation's summary (`summary(g)`, as the token view shows
// it); a tool call's bubble offers `forkAfter(position)` right after the call and its result. A generation no chat request asked for (a re-run from this page, a plain generate call) is
// shown where it sits in the history, as the model's raw text.
export function chatView(doc, summary, forkAfter) {
  const gens = new Map(doc.generations.map((g) => [g.id, g]));
  const items = doc.conversation.map((t, i) => ({ start: t.start, turn: t, i }));
  const replied = new Set(doc.conversation.map((t) => t.generation_id).filter(Boolean));
  // (one with no tokens yet is left out: a chat request's generation starts a commit before its request)
  for (const g of doc.generations) if (!replied.has(g.id) && g.tokens.length) items.push({ start: g.prompt_length, gen: g });
  items.sort((a, b) => a.start - b.start);  // stable: turns keep their order
  // a call's result is shown beneath its call, not on its own
  const calls = new Set(doc.conversation.filter((t) => t.role === "tool_call").map((t) => t.call?.id));
  const results = new Map();
  doc.conversation.forEach((t, i) => { if (t.role === "tool" && calls.has(t.call_id)) results.set(t.call_id, { turn: t, i }); });
  const out = [];
  for (const { turn: t, i, gen } of items) {
    if (t?.role === "tool_call") { out.push(toolCall(t, i, results.get(t.call?.id), forkAfter)); continue; }
    if (t?.role === "tool" && results.get(t.call_id)?.i === i) continue;
    const g = gen || (t.generation_id ? gens.get(t.generation_id) : null);
    const streaming = g?.status === "running" ? " streaming" : "";
    if (gen) {
      const end = gen.prompt_length + gen.tokens.length;
      out.push(bubble(`assistant generation${streaming}`, { "data-role": "model", "data-gen": gen.id, "data-start": gen.prompt_length,
        "data-end": end, title: `tokens ${gen.prompt_length}–${end}` }, "model (no chat request)", gen.text ?? ""));
    } else {
      out.push(bubble(`${t.role}${t.inherited ? " inherited" : ""}${streaming}`, { "data-turn": i, "data-role": t.role,
        "data-gen": t.generation_id, "data-start": t.start, "data-end": t.end, title: `tokens ${t.start}–${t.end}` },
      t.inherited ? `${t.role} · from the parent session` : t.role, t.text ?? `[tokens ${t.start}–${t.end}]`));
    }
    if (g) out.push(summary(g));
  }
  return out;
}

// The chat view of a session the OpenAI routes drove: its document's `conversation` (one turn per
// message, in the order the chat template placed them, then each reply) as bubbles by role. The
// turns are the document's, so a live session's reply grows as its tokens arrive, and a scrubbed-back
// document shows the conversation as it was then (later turns absent, a reply cut to what existed).
import { h } from "/static/dom.js";

function bubble(cls, attrs, label, text) {
  return h("div", { class: `bubble ${cls}`, ...attrs }, h("span", { class: "who" }, label), h("div", { class: "bubble-text" }, text));
}

// The bubbles, each reply followed by its generation's summary (`summary(g)`, as the token view shows
// it). A generation no chat request asked for (a re-run from this page, a plain generate call) is
// shown where it sits in the history, as the model's raw text.
export function chatView(doc, summary) {
  const gens = new Map(doc.generations.map((g) => [g.id, g]));
  const items = doc.conversation.map((t, i) => ({ start: t.start, turn: t, i }));
  const replied = new Set(doc.conversation.map((t) => t.generation_id).filter(Boolean));
  // (one with no tokens yet is left out: a chat request's generation starts a commit before its request)
  for (const g of doc.generations) if (!replied.has(g.id) && g.tokens.length) items.push({ start: g.prompt_length, gen: g });
  items.sort((a, b) => a.start - b.start);  // stable: turns keep their order
  const out = [];
  for (const { turn: t, i, gen } of items) {
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

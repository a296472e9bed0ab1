// DOM helpers shared by the viewer's modules: element construction and an in-place redraw.

// h("div", { class: "x", onclick: f, "data-id": 1 }, child, [children], "text")
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) el.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}

// Make `parent`'s children `next`, keeping each existing node that equals its replacement (or, for an
// element with the same tag and attributes, morphing its children): a live session redraws on every
// committed event, and a click (mousedown, then mouseup) on a node replaced in between would be lost.
export function morph(parent, next) {
  for (let i = 0; i < next.length; i++) {
    const want = next[i];
    const have = parent.childNodes[i];
    if (!have) parent.append(want);
    else if (have.isEqualNode(want)) continue;
    else if (have.nodeType === 1 && want.nodeType === 1 && have.tagName === want.tagName && sameAttributes(have, want)) {
      morph(have, [...want.childNodes]);
    } else parent.replaceChild(want, have);
  }
  while (parent.childNodes.length > next.length) parent.lastChild.remove();
}

function sameAttributes(a, b) {
  if (a.attributes.length !== b.attributes.length) return false;
  for (const { name, value } of a.attributes) if (b.getAttribute(name) !== value) return false;
  return true;
}


// JSON Patch+ applier: RFC 6902 ops plus `append` (string concat / array push), the browser twin of
// core/patch.py (docs/protocols/json-patch-plus.md); both pass tests/data/json_patch_cases.json.
// applyPatch returns the new root; on a bad patch it throws PatchError and `doc` is as it was: it
// works on a copy, or, when the caller owns `doc` (inPlace), undoes the ops it had applied.

export class PatchError extends Error {}

const OPS = new Set(["add", "remove", "replace", "move", "copy", "test", "append"]);
const NEEDS_VALUE = new Set(["add", "replace", "test", "append"]);
const has = (obj, key) => Object.prototype.hasOwnProperty.call(obj, key);

// -- pointers (RFC 6901) --------------------------------------------------------------------

export function parsePointer(ptr) {
  if (typeof ptr !== "string") throw new PatchError(`pointer must be a string, got ${kind(ptr)}`);
  if (ptr === "") return [];
  if (ptr[0] !== "/") throw new PatchError(`pointer ${JSON.stringify(ptr)} must be empty or start with '/'`);
  return ptr.slice(1).split("/").map((t) => {
    if (/~[^01]|~$/.test(t)) throw new PatchError(`pointer ${JSON.stringify(ptr)}: '~' must be followed by 0 or 1`);
    return t.replace(/~1/g, "/").replace(/~0/g, "~");
  });
}

// Decimal digits, no leading zeros, no sign; "-" (the end) only where allowEnd.
function index(token, length, allowEnd) {
  if (allowEnd && token === "-") return length;
  if (!/^(0|[1-9][0-9]*)$/.test(token)) throw new PatchError(`${JSON.stringify(token)} is not an array index`);
  const i = Number(token);
  if (i > length || (i === length && !allowEnd)) throw new PatchError(`index ${token} is out of range (length ${length})`);
  return i;
}

function child(node, token) {
  if (Array.isArray(node)) return node[index(token, node.length, false)];
  if (node !== null && typeof node === "object") {
    if (!has(node, token)) throw new PatchError(`no member ${JSON.stringify(token)}`);
    return node[token];
  }
  throw new PatchError(`cannot descend into a ${kind(node)}`);
}

export function resolve(doc, ptr) {
  return parsePointer(ptr).reduce(child, doc);
}

function parentOf(doc, ptr) {
  const tokens = parsePointer(ptr);
  const last = tokens.pop();
  const parent = tokens.reduce(child, doc);
  if (parent === null || typeof parent !== "object") {
    throw new PatchError(`pointer ${JSON.stringify(ptr)}: parent is a ${kind(parent)}, not a container`);
  }
  return [parent, last];
}

// -- JSON values ----------------------------------------------------------------------------

export function kind(v) {
  if (v === null) return "null";
  if (Array.isArray(v)) return "array";
  return typeof v; // boolean, number, string, object (and undefined, which JSON has not)
}

// Equality as RFC 6902 `test` means it: objects by members whatever their order, arrays element
// by element, numbers by value (1 equals 1.0), and no kind equals another (true is not 1).
export function jsonEqual(a, b) {
  const k = kind(a);
  if (k !== kind(b)) return false;
  if (k === "array") return a.length === b.length && a.every((x, i) => jsonEqual(x, b[i]));
  if (k === "object") {
    const keys = Object.keys(a);
    return keys.length === Object.keys(b).length && keys.every((key) => has(b, key) && jsonEqual(a[key], b[key]));
  }
  return a === b;
}

// -- mutations, each recording its inverse in `undo` (an array, or null for none) -------------

function define(obj, key, value) {
  // `obj.__proto__ = v` would set the prototype, not a member
  if (key === "__proto__") Object.defineProperty(obj, key, { value, writable: true, enumerable: true, configurable: true });
  else obj[key] = value;
}

function setMember(obj, key, value, undo) {
  if (undo) {
    if (has(obj, key)) { const old = obj[key]; undo.push(() => define(obj, key, old)); }
    else undo.push(() => { delete obj[key]; });
  }
  define(obj, key, value);
}

function deleteMember(obj, key, undo) {
  const value = obj[key];
  if (undo) {
    const keys = Object.keys(obj);
    undo.push(() => { // put it back where it was: re-add it, then move the members after it behind it
      define(obj, key, value);
      for (const k of keys.slice(keys.indexOf(key) + 1)) { const v = obj[k]; delete obj[k]; define(obj, k, v); }
    });
  }
  delete obj[key];
  return value;
}

function insertAt(arr, i, value, undo) {
  if (i === arr.length) arr.push(value);
  else arr.splice(i, 0, value);
  undo?.push(() => arr.splice(i, 1));
}

function removeAt(arr, i, undo) {
  const [value] = arr.splice(i, 1);
  undo?.push(() => arr.splice(i, 0, value));
  return value;
}

function setAt(arr, i, value, undo) {
  const old = arr[i];
  arr[i] = value;
  undo?.push(() => { arr[i] = old; });
}

// -- the operations -------------------------------------------------------------------------

function add(doc, ptr, value, undo) {
  if (ptr === "") return value;
  const [parent, key] = parentOf(doc, ptr);
  if (Array.isArray(parent)) insertAt(parent, index(key, parent.length, true), value, undo);
  else setMember(parent, key, value, undo);
  return doc;
}

function remove(doc, ptr, undo) {
  if (ptr === "") throw new PatchError("cannot remove the whole document");
  const [parent, key] = parentOf(doc, ptr);
  if (Array.isArray(parent)) return [doc, removeAt(parent, index(key, parent.length, false), undo)];
  child(parent, key);
  return [doc, deleteMember(parent, key, undo)];
}

function replace(doc, ptr, value, undo) {
  if (ptr === "") return value;
  const [parent, key] = parentOf(doc, ptr);
  if (Array.isArray(parent)) setAt(parent, index(key, parent.length, false), value, undo);
  else { child(parent, key); setMember(parent, key, value, undo); }
  return doc;
}

function append(doc, ptr, value, undo) {
  const target = resolve(doc, ptr);
  if (Array.isArray(target)) { insertAt(target, target.length, value, undo); return doc; }
  if (typeof target === "string") {
    if (typeof value !== "string") throw new PatchError(`append to the string at ${ptr} needs a string value, got ${kind(value)}`);
    return replace(doc, ptr, target + value, undo);
  }
  throw new PatchError(`append at ${ptr}: target is a ${kind(target)}, not a string or array`);
}

function move(doc, from, ptr, n, undo) {
  if (ptr !== from && ptr.startsWith(from + "/")) throw new PatchError(`operation ${n} (move): cannot move ${from} into its own child ${ptr}`);
  if (ptr === from) { resolve(doc, from); return doc; }
  const [d, value] = remove(doc, from, undo);
  return add(d, ptr, value, undo);
}

function checkOp(op, n) {
  if (op === null || typeof op !== "object" || Array.isArray(op)) throw new PatchError(`operation ${n} is not an object`);
  const name = op.op;
  if (typeof name !== "string" || !OPS.has(name)) throw new PatchError(`operation ${n}: unknown op ${JSON.stringify(name)}`);
  if (typeof op.path !== "string") throw new PatchError(`operation ${n} (${name}): 'path' must be a string`);
  if (NEEDS_VALUE.has(name) && !has(op, "value")) throw new PatchError(`operation ${n} (${name}): 'value' is required`);
  if ((name === "move" || name === "copy") && typeof op.from !== "string") throw new PatchError(`operation ${n} (${name}): 'from' must be a string`);
  return name;
}

// One op, applied to `doc` in place where possible; returns the new root.
export function applyOp(doc, op, n = 0, undo = null) {
  const name = checkOp(op, n);
  const path = op.path;
  switch (name) {
    case "add": return add(doc, path, structuredClone(op.value), undo);
    case "remove": return remove(doc, path, undo)[0];
    case "replace": return replace(doc, path, structuredClone(op.value), undo);
    case "append": return append(doc, path, structuredClone(op.value), undo);
    case "test":
      if (!jsonEqual(resolve(doc, path), op.value)) throw new PatchError(`operation ${n} (test): value at ${path} differs`);
      return doc;
    case "copy": return add(doc, path, structuredClone(resolve(doc, op.from)), undo);
    default: return move(doc, op.from, path, n, undo);
  }
}

// All or nothing: on a copy of `doc`, or, with inPlace (the caller owns `doc`), on `doc` itself
// with every change undone when an op fails.
export function applyPatch(doc, ops, inPlace = false) {
  if (!Array.isArray(ops)) throw new PatchError("a patch must be an array of operations");
  if (!inPlace) return ops.reduce((out, op, n) => applyOp(out, op, n), structuredClone(doc));
  const undo = [];
  let out = doc;
  try {
    for (let n = 0; n < ops.length; n++) out = applyOp(out, ops[n], n, undo);
  } catch (err) {
    for (let i = undo.length - 1; i >= 0; i--) undo[i]();
    throw err;
  }
  return out;
}

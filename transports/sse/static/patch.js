// JSON Patch+ applier: RFC 6902 ops plus `append` (string concat / array push).
// applyPatch returns the new root; it throws PatchError and leaves `doc` untouched on a bad patch.

export class PatchError extends Error {}

export function parsePointer(ptr) {
  if (ptr === "") return [];
  if (typeof ptr !== "string" || ptr[0] !== "/") throw new PatchError(`bad pointer ${ptr}`);
  return ptr.slice(1).split("/").map((t) => {
    if (/~[^01]|~$/.test(t)) throw new PatchError(`bad escape in ${ptr}`);
    return t.replace(/~1/g, "/").replace(/~0/g, "~");
  });
}

function index(token, length, allowEnd) {
  if (allowEnd && token === "-") return length;
  if (!/^(0|[1-9][0-9]*)$/.test(token)) throw new PatchError(`${token} is not an array index`);
  const i = Number(token);
  if (i > length || (i === length && !allowEnd)) throw new PatchError(`index ${i} out of range`);
  return i;
}

function child(node, token) {
  if (Array.isArray(node)) return node[index(token, node.length, false)];
  if (node !== null && typeof node === "object") {
    if (!Object.prototype.hasOwnProperty.call(node, token)) throw new PatchError(`no member ${token}`);
    return node[token];
  }
  throw new PatchError(`cannot descend into ${typeof node}`);
}

export function resolve(doc, ptr) {
  return parsePointer(ptr).reduce(child, doc);
}

function parentOf(doc, ptr) {
  const tokens = parsePointer(ptr);
  const last = tokens.pop();
  const parent = tokens.reduce(child, doc);
  if (parent === null || typeof parent !== "object") throw new PatchError(`parent of ${ptr} is not a container`);
  return [parent, last];
}

function add(doc, ptr, value) {
  if (ptr === "") return value;
  const [parent, key] = parentOf(doc, ptr);
  if (Array.isArray(parent)) parent.splice(index(key, parent.length, true), 0, value);
  else parent[key] = value;
  return doc;
}

function remove(doc, ptr) {
  if (ptr === "") throw new PatchError("cannot remove the document");
  const [parent, key] = parentOf(doc, ptr);
  if (Array.isArray(parent)) return [doc, parent.splice(index(key, parent.length, false), 1)[0]];
  const value = child(parent, key);
  delete parent[key];
  return [doc, value];
}

function replace(doc, ptr, value) {
  if (ptr === "") return value;
  const [parent, key] = parentOf(doc, ptr);
  if (Array.isArray(parent)) parent[index(key, parent.length, false)] = value;
  else { child(parent, key); parent[key] = value; }
  return doc;
}

function equal(a, b) { return JSON.stringify(a) === JSON.stringify(b); }
const clone = (v) => (v === undefined ? v : structuredClone(v));

export function applyOp(doc, op) {
  if (!op || typeof op.path !== "string") throw new PatchError("operation without a path");
  switch (op.op) {
    case "add": return add(doc, op.path, clone(op.value));
    case "remove": return remove(doc, op.path)[0];
    case "replace": return replace(doc, op.path, clone(op.value));
    case "append": {
      const target = resolve(doc, op.path);
      if (Array.isArray(target)) { target.push(clone(op.value)); return doc; }
      if (typeof target === "string" && typeof op.value === "string") return replace(doc, op.path, target + op.value);
      throw new PatchError(`cannot append to ${op.path}`);
    }
    case "test":
      if (!equal(resolve(doc, op.path), op.value)) throw new PatchError(`test failed at ${op.path}`);
      return doc;
    case "copy": return add(doc, op.path, clone(resolve(doc, op.from)));
    case "move": {
      if (op.path.startsWith(op.from + "/")) throw new PatchError("cannot move into a child");
      const [d, value] = remove(doc, op.from);
      return add(d, op.path, value);
    }
    default: throw new PatchError(`unknown op ${op.op}`);
  }
}

// All-or-nothing: work on a copy unless the caller owns `doc` (inPlace).
export function applyPatch(doc, ops, inPlace = false) {
  if (!Array.isArray(ops)) throw new PatchError("a patch must be an array");
  let out = inPlace ? doc : structuredClone(doc);
  for (const op of ops) out = applyOp(out, op);
  return out;
}

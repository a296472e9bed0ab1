// Runs the shared JSON Patch+ cases against the viewer's applier (tests/transports/http/test_patch_js.py).
//
//   node patch_cases.mjs PATCH_JS CASES_JSON
//
// prints one JSON array, one entry per case, in the file's order, for each way the viewer calls
// applyPatch: on a copy ("copy") and on a document it owns ("inPlace"). Each way gives either
// {"result": the patched document} or {"error": "PatchError: message", "patchError": true}, and "unchanged": whether
// the document passed in serialises as before the call (the copy way must never touch it; the
// inPlace way must leave it as it was when the patch fails). "polluted" reports a member that
// leaked onto Object.prototype. The Python test judges the results against the cases.
import { readFileSync } from "node:fs";

const [patchJs, casesFile] = process.argv.slice(2);
// patch.js is a browser module that names no module type: import its text as one.
const source = readFileSync(patchJs, "utf8");
const { applyPatch, PatchError } = await import(`data:text/javascript;base64,${Buffer.from(source).toString("base64")}`);
const { cases } = JSON.parse(readFileSync(casesFile, "utf8"));

function run(doc, patch, inPlace) {
  const before = JSON.stringify(doc);
  const out = {};
  try {
    out.result = applyPatch(doc, patch, inPlace);
  } catch (err) {
    out.error = `${err?.constructor?.name ?? typeof err}: ${err?.message ?? err}`;
    out.patchError = err instanceof PatchError;
  }
  if (!inPlace || "error" in out) out.unchanged = JSON.stringify(doc) === before;
  return out;
}

const results = cases.map((c) => ({
  comment: c.comment,
  // each way gets its own parse of the case, so neither sees what the other did
  copy: run(structuredClone(c.doc), structuredClone(c.patch), false),
  inPlace: run(structuredClone(c.doc), structuredClone(c.patch), true),
}));
const polluted = Object.keys(Object.prototype).concat(Object.keys(Array.prototype));
process.stdout.write(JSON.stringify({ results, polluted }));

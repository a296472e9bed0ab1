// llama.cpp (through node-llama-cpp) as a speed peer for bench/bench_models.py.
//
// Install once, outside the repository (the package carries prebuilt llama.cpp binaries; this
// script only ever loads the CPU one, and never builds or downloads anything):
//
//     mkdir -p /tmp/llamapeer && cd /tmp/llamapeer && npm i -E node-llama-cpp@3.21.1
//
// Run:
//
//     node bench/peers/llama_cpp_peer.mjs --model PATH.gguf [--threads 2] [--context 2048] \
//         [--sequences 1] [--peer-dir /tmp/llamapeer] [--job JSON]
//
// (--peer-dir is the folder where `npm i` ran; /tmp/llamapeer unless given.)
//
// It loads the model once (all layers on the CPU), prints one JSON line
// {"event": "loaded", ...}, then runs jobs: the one given with --job, or else one per line of
// standard input until it ends. A job is a JSON object:
//
//     {"prompt_ids": [1, 2, ...]}  or  {"prompt": "text", "special": true}
//     "max_tokens": 24     new tokens to generate, greedily (temperature 0); EOG tokens do not
//                          stop it, as sessiontape's engine with no stop ids does not stop
//
//     {"batch": [[1, 2, ...], ...], "max_tokens": 64, "stop_ids": [2]}   (with --sequences N
//                          >= the batch's length) the prompts generated at once, greedily, each on
//                          a sequence of its own in the one context (--context tokens per
//                          sequence), each until max_tokens or one of stop_ids (included):
//                          llama.cpp evaluates the sequences' pending tokens together, one batch
//                          per step
//
// and each job prints one JSON line {"event": "result", ...}: the prompt's length (and for a
// text prompt, its ids as llama.cpp tokenized it), the time to first token (the whole prompt
// evaluated in one batch, plus sampling the first token: "prefill"), prefill tokens/s (prompt
// tokens / that time), the time of each later token, decode tokens/s (tokens after the first /
// their time), the generated ids, and this process's peak RSS so far (getrusage's maxrss, and
// VmHWM from /proc/self/status). Each job starts from an empty KV cache. A batch job's result
// gives the wall time from the first prompt's start to the last token of all (wall_s), each
// sequence's generated ids and its time to first token.
//
// Checked against tests/data/smollm2_reference.json (transformers, float32): llama.cpp tokenizes
// all 8 recorded prompts to the same ids, and its greedy ids equal transformers' for all 24
// tokens on 6 of them; on "greeting" for 18 (through the EOS at 7; a 0.10-nat near-tie after
// it), and on "france" it parts at the first token, a 0.08-nat near-tie in float32 ("The" vs
// "L"), which its Q8-rounded activations tip the other way.

import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";

function parseArgs(argv) {
    const out = {
        threads: 2,
        context: 2048,
        sequences: 1,
        peerDir: "/tmp/llamapeer",
        model: null,
        job: null,
    };
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        const next = () => {
            if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
            return argv[++i];
        };
        if (a === "--model") out.model = next();
        else if (a === "--threads") out.threads = Number(next());
        else if (a === "--context") out.context = Number(next());
        else if (a === "--sequences") out.sequences = Number(next());
        else if (a === "--peer-dir") out.peerDir = next();
        else if (a === "--job") out.job = next();
        else throw new Error(`unknown argument ${a}`);
    }
    if (!out.model) throw new Error("--model PATH.gguf is required");
    return out;
}

function peerVersion(peerDir) {
    const pkg = path.join(path.resolve(peerDir), "node_modules", "node-llama-cpp", "package.json");
    try {
        return JSON.parse(readFileSync(pkg, "utf8")).version;
    } catch {
        return null;
    }
}

async function importPeer(peerDir) {
    // resolve the package from the folder where `npm i` ran, not from this script's folder
    const require = createRequire(path.join(path.resolve(peerDir), "package.json"));
    let entry;
    try {
        entry = require.resolve("node-llama-cpp");
    } catch {
        // an ESM-only package has no "require" condition: find its folder and read its main
        const dir = path.join(path.resolve(peerDir), "node_modules", "node-llama-cpp");
        const pkg = JSON.parse(readFileSync(path.join(dir, "package.json"), "utf8"));
        const main = pkg.exports?.["."]?.import ?? pkg.exports?.["."]?.default ?? pkg.main;
        entry = path.join(dir, typeof main === "string" ? main : "dist/index.js");
    }
    return import(pathToFileURL(entry).href);
}

function peakRss() {
    // resourceUsage().maxRSS is in KiB on Linux
    const maxrss = process.resourceUsage().maxRSS / 1024;
    let hwm = null;
    try {
        const m = /VmHWM:\s+(\d+) kB/.exec(readFileSync("/proc/self/status", "utf8"));
        if (m) hwm = Number(m[1]) / 1024;
    } catch {
        // not Linux: maxrss only
    }
    return {
        peak_rss_mib: hwm ?? maxrss,
        maxrss_mib: maxrss,
        rss_now_mib: process.memoryUsage().rss / (1 << 20),
    };
}

function emit(obj) {
    process.stdout.write(JSON.stringify(obj) + "\n");
}

async function runJob(model, sequence, job) {
    let ids;
    if (Array.isArray(job.prompt_ids)) ids = job.prompt_ids.map(Number);
    else if (typeof job.prompt === "string") ids = model.tokenize(job.prompt, job.special ?? true);
    else throw new Error("a job needs prompt_ids (a list) or prompt (text)");
    const maxTokens = Number(job.max_tokens ?? 24);
    if (!(maxTokens >= 1)) throw new Error("max_tokens must be >= 1");
    if (job.greedy === false) throw new Error("only greedy decoding is measured");
    await sequence.clearHistory();
    const out = [];
    const stepS = [];
    const t0 = process.hrtime.bigint();
    let last = t0;
    let ttft = 0;
    // temperature 0: the greedy sampler; yieldEogToken: EOS does not end the run
    const gen = sequence.evaluate(ids, { temperature: 0, yieldEogToken: true });
    try {
        for await (const token of gen) {
            const now = process.hrtime.bigint();
            const dt = Number(now - last) / 1e9;
            last = now;
            if (out.length === 0) ttft = dt;
            else stepS.push(dt);
            out.push(token);
            if (out.length >= maxTokens) break;
        }
    } finally {
        await gen.return?.();
    }
    const decodeS = stepS.reduce((a, b) => a + b, 0);
    return {
        event: "result",
        prompt_tokens: ids.length,
        // the ids of a text prompt, as llama.cpp's tokenizer made them
        prompt_ids: Array.isArray(job.prompt_ids) ? undefined : ids,
        ttft_s: ttft,
        prefill_tok_s: ids.length / ttft,
        decode_step_s: stepS,
        decode_tok_s: stepS.length ? stepS.length / decodeS : null,
        ids: out,
        text: job.detokenize ? model.detokenize(out) : undefined,
        ...peakRss(),
    };
}

async function generate(sequence, ids, maxTokens, stopIds, t0) {
    // greedy from an empty history, until maxTokens or one of stopIds. Times are from t0.
    await sequence.clearHistory();
    const out = [];
    let ttft = null;
    const gen = sequence.evaluate(ids, { temperature: 0, yieldEogToken: true });
    try {
        for await (const token of gen) {
            if (ttft === null) ttft = Number(process.hrtime.bigint() - t0) / 1e9;
            out.push(token);
            if (out.length >= maxTokens || stopIds.has(token)) break;
        }
    } finally {
        await gen.return?.();
    }
    return { ids: out, ttft_s: ttft, done_s: Number(process.hrtime.bigint() - t0) / 1e9 };
}

async function runBatch(sequences, job) {
    const prompts = job.batch.map((p) => p.map(Number));
    if (prompts.length > sequences.length)
        throw new Error(`a batch of ${prompts.length} needs --sequences ${prompts.length}`);
    const maxTokens = Number(job.max_tokens ?? 64);
    if (!(maxTokens >= 1)) throw new Error("max_tokens must be >= 1");
    const stopIds = new Set((job.stop_ids ?? []).map(Number));
    const t0 = process.hrtime.bigint();
    const runs = await Promise.all(
        prompts.map((ids, i) => generate(sequences[i], ids, maxTokens, stopIds, t0)),
    );
    const wallS = Number(process.hrtime.bigint() - t0) / 1e9;
    const tokens = runs.reduce((a, r) => a + r.ids.length, 0);
    return {
        event: "result",
        wall_s: wallS,
        tokens,
        tok_s: tokens / wallS,
        prompt_tokens: prompts.reduce((a, p) => a + p.length, 0),
        ids: runs.map((r) => r.ids),
        ttft_s: runs.map((r) => r.ttft_s),
        ...peakRss(),
    };
}

async function main() {
    const args = parseArgs(process.argv.slice(2));
    const t0 = process.hrtime.bigint();
    const { getLlama, LlamaLogLevel } = await importPeer(args.peerDir);
    // gpu: false → the CPU build; build: "never" → a prebuilt binary or an error, never a compile
    const llama = await getLlama({
        gpu: false,
        build: "never",
        skipDownload: true,
        logLevel: LlamaLogLevel.error,
        maxThreads: args.threads,
    });
    const model = await llama.loadModel({ modelPath: args.model, gpuLayers: 0 });
    const context = await model.createContext({
        contextSize: args.context,
        sequences: args.sequences,
        threads: { ideal: args.threads, min: args.threads },
    });
    const sequences = Array.from({ length: args.sequences }, () => context.getSequence());
    const loadS = Number(process.hrtime.bigint() - t0) / 1e9;
    emit({
        event: "loaded",
        load_s: loadS,
        gpu: llama.gpu,
        threads: context.currentThreads,
        sequences: args.sequences,
        context: context.contextSize,
        batch: context.batchSize,
        llama_cpp_release: llama.llamaCppRelease?.release ?? null,
        node_llama_cpp: peerVersion(args.peerDir),
        about: `llama.cpp ${llama.llamaCppRelease?.release ?? "?"} (node-llama-cpp ${peerVersion(args.peerDir) ?? "?"}, ${llama.buildType ?? "?"} CPU build, node ${process.version})`,
        build_type: llama.buildType ?? null,
        model_size_bytes: model.size,
        ...peakRss(),
    });
    if (args.job != null) {
        emit(await run(model, sequences, JSON.parse(args.job)));
    } else {
        const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
        for await (const line of lines) {
            if (!line.trim()) continue;
            try {
                emit(await run(model, sequences, JSON.parse(line)));
            } catch (err) {
                emit({ event: "error", error: String(err?.stack ?? err) });
            }
        }
    }
    await context.dispose();
    await model.dispose();
    await llama.dispose();
}

function run(model, sequences, job) {
    return Array.isArray(job.batch) ? runBatch(sequences, job) : runJob(model, sequences[0], job);
}

main().catch((err) => {
    emit({ event: "error", error: String(err?.stack ?? err) });
    process.exitCode = 1;
});
